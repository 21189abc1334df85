package services

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weightd/weightd/internal/freeport"
)

// RegistryBinary is Debian's docker-registry (distribution 2.8).
const RegistryBinary = "/usr/bin/docker-registry"

// RegistryConfig configures StartRegistry.
type RegistryConfig struct {
	// Dir holds the registry's storage, config and log. Required.
	Dir string
	// TokenAuth requires Docker registry bearer tokens, issued by an
	// in-process token server to Username and Password only.
	TokenAuth bool
}

// Registry is a docker-registry process on loopback behind a byte-counting
// TCP proxy. Its methods are safe for concurrent use.
type Registry struct {
	// Addr is host:port of the proxy, the registry's address for clients;
	// it stays the same across Stop and Start. Use it with plain HTTP.
	Addr string
	// Username and Password are the credentials the token server accepts
	// (TokenAuth only; empty otherwise).
	Username, Password string
	// Dir is RegistryConfig.Dir.
	Dir string

	ln     net.Listener
	secret string // http.secret: the same across restarts, so uploads resume
	served atomic.Int64
	token  *tokenServer // nil without TokenAuth

	mu       sync.Mutex
	proc     *process
	upstream string // host:port of the running registry; "" while stopped
	conns    map[net.Conn]struct{}
	closed   bool
	proxyWG  sync.WaitGroup
}

// DirectAddr is host:port of the registry process itself, bypassing the
// byte-counting proxy (a user-space copy): for benchmarks that measure the
// registry's speed rather than its traffic. It changes across Stop and
// Start, and is "" while stopped.
func (r *Registry) DirectAddr() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.upstream
}

// StartRegistry starts docker-registry on a free loopback port with its
// storage under cfg.Dir, and the proxy in front of it, and waits until it
// answers. Close stops both.
func StartRegistry(ctx context.Context, cfg RegistryConfig) (*Registry, error) {
	if cfg.Dir == "" {
		return nil, errors.New("registry: no directory")
	}
	if err := RegistryAvailable(); err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, err
	}
	cfg.Dir = dir
	for _, d := range []string{cfg.Dir, filepath.Join(cfg.Dir, "storage")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("registry proxy: %w", err)
	}
	r := &Registry{Addr: ln.Addr().String(), Dir: cfg.Dir, ln: ln, secret: randomHex(16), conns: make(map[net.Conn]struct{})}
	if cfg.TokenAuth {
		r.Username = "weightd-" + randomHex(4)
		r.Password = randomHex(16)
		r.token, err = startTokenServer(cfg.Dir, r.Username, r.Password)
		if err != nil {
			ln.Close()
			return nil, err
		}
	}
	r.proxyWG.Go(r.accept)
	if err := r.Start(ctx); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

// Start starts the registry again after Stop, on the same storage and
// behind the same Addr. It does nothing if the registry is running.
func (r *Registry) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return errors.New("registry closed")
	}
	if r.proc != nil && !r.proc.exited() {
		return nil
	}
	var last error
	for range 3 { // the free port may be taken between probe and bind
		port, err := freeport.Port("127.0.0.1")
		if err != nil {
			return err
		}
		upstream := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		conf := filepath.Join(r.Dir, "config.yml")
		if err := os.WriteFile(conf, []byte(r.config(upstream)), 0o644); err != nil {
			return err
		}
		p, err := startProcess(RegistryBinary, []string{"serve", conf}, filepath.Join(r.Dir, "registry.log"))
		if err != nil {
			return err
		}
		err = p.waitFor(ctx, 15*time.Second, "docker-registry", func() error { return probeRegistry(upstream) })
		if err == nil {
			r.proc, r.upstream = p, upstream
			return nil
		}
		p.stop(time.Second)
		last = err
	}
	return fmt.Errorf("starting docker-registry: %w", last)
}

// Stop stops the registry process and closes every proxied connection; until
// Start, the proxy closes each new connection at once, as an upstream that is
// down would.
func (r *Registry) Stop() {
	r.mu.Lock()
	p := r.proc
	r.proc, r.upstream = nil, ""
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	if p != nil {
		p.stop(5 * time.Second)
	}
}

// Revoke withdraws every credential and token the registry has given
// (TokenAuth only): the token server takes a new Password and a new signing
// key, and the registry restarts trusting only that key, as a registry
// refuses a user whose access was withdrawn once the tokens issued before
// have expired.
func (r *Registry) Revoke(ctx context.Context) error {
	if r.token == nil {
		return errors.New("registry: Revoke needs TokenAuth")
	}
	pass := randomHex(16)
	if err := r.token.rotate(pass); err != nil {
		return err
	}
	r.Password = pass
	r.Stop()
	return r.Start(ctx)
}

// Close stops the registry, the proxy and the token server. The storage is
// left in Dir.
func (r *Registry) Close() error {
	r.Stop()
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	err := r.ln.Close()
	r.proxyWG.Wait()
	if r.token != nil {
		r.token.close()
	}
	return err
}

// BytesServed is the number of bytes sent to clients through the proxy since
// the registry started.
func (r *Registry) BytesServed() int64 { return r.served.Load() }

// LogTail returns the end of the registry's log, for failure messages.
func (r *Registry) LogTail() string { return fileTail(filepath.Join(r.Dir, "registry.log"), 8192) }

func (r *Registry) config(upstream string) string {
	c := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
  secret: %s
`, filepath.Join(r.Dir, "storage"), upstream, r.secret)
	if r.token != nil {
		c += fmt.Sprintf(`auth:
  token:
    realm: %s
    service: %s
    issuer: %s
    rootcertbundle: %s
`, r.token.realm(), tokenService, tokenIssuer, r.token.bundle)
	}
	return c
}

// probeRegistry succeeds once GET /v2/ answers 200 or 401.
func probeRegistry(hostport string) error {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + hostport + "/v2/")
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusUnauthorized {
		return fmt.Errorf("GET /v2/: %s", resp.Status)
	}
	return nil
}

func (r *Registry) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		r.mu.Lock()
		upstream := r.upstream
		if upstream == "" || r.closed {
			r.mu.Unlock()
			c.Close()
			continue
		}
		r.conns[c] = struct{}{}
		r.mu.Unlock()
		r.proxyWG.Go(func() { r.proxy(c, upstream) })
	}
}

func (r *Registry) proxy(c net.Conn, upstream string) {
	defer func() {
		r.mu.Lock()
		delete(r.conns, c)
		r.mu.Unlock()
		c.Close()
	}()
	u, err := net.DialTimeout("tcp", upstream, 5*time.Second)
	if err != nil {
		return
	}
	r.mu.Lock()
	if r.upstream != upstream { // stopped while dialling
		r.mu.Unlock()
		u.Close()
		return
	}
	r.conns[u] = struct{}{}
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.conns, u)
		r.mu.Unlock()
		u.Close()
	}()
	var wg sync.WaitGroup
	wg.Go(func() {
		_, _ = io.Copy(u, c)
		_ = u.(*net.TCPConn).CloseWrite()
	})
	_, _ = io.Copy(countingWriter{c, &r.served}, u)
	_ = c.(*net.TCPConn).CloseWrite()
	wg.Wait()
}

type countingWriter struct {
	w io.Writer
	n *atomic.Int64
}

// Write counts p before writing it, so that a client that has read bytes
// never finds them not yet counted; what is not written is taken back.
func (w countingWriter) Write(p []byte) (int, error) {
	w.n.Add(int64(len(p)))
	n, err := w.w.Write(p)
	w.n.Add(int64(n - len(p)))
	return n, err
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
