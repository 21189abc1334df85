package benchnet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/internal/testbed"
)

// Clients of the registry, told apart by their User-Agent.
const (
	ClientContainerd = "containerd" // containerd's resolver: "containerd/<version>"
	ClientWeightd    = "weightd"    // the agents' OCI source: "weightd/<version> go-containerregistry/…"
	ClientOther      = "other"
)

// clientOf classifies a request by its User-Agent.
func clientOf(userAgent string) string {
	switch {
	case strings.Contains(userAgent, "weightd/"):
		return ClientWeightd
	case strings.Contains(userAgent, "containerd/"):
		return ClientContainerd
	default:
		return ClientOther
	}
}

// Traffic is what one client's blob GETs to the registry carried.
type Traffic struct {
	// BlobGets counts its GET requests for blobs, whatever their answer.
	BlobGets int64 `json:"blob_gets"`
	// BlobBytes counts the response body bytes the registry sent it for them.
	BlobBytes int64 `json:"blob_bytes"`
}

// RegistryTraffic is the registry's blob traffic by client address (the
// testbed host's) and client (ClientContainerd, ClientWeightd,
// ClientOther).
type RegistryTraffic map[string]map[string]Traffic

// Sub returns t less before: the traffic between two readings.
func (t RegistryTraffic) Sub(before RegistryTraffic) RegistryTraffic {
	out := make(RegistryTraffic, len(t))
	for addr, clients := range t {
		out[addr] = make(map[string]Traffic, len(clients))
		for c, x := range clients {
			b := before[addr][c]
			out[addr][c] = Traffic{BlobGets: x.BlobGets - b.BlobGets, BlobBytes: x.BlobBytes - b.BlobBytes}
		}
	}
	return out
}

// ByClient sums t over the addresses.
func (t RegistryTraffic) ByClient() map[string]Traffic {
	out := map[string]Traffic{ClientContainerd: {}, ClientWeightd: {}, ClientOther: {}}
	for _, clients := range t {
		for c, x := range clients {
			s := out[c]
			s.BlobGets += x.BlobGets
			s.BlobBytes += x.BlobBytes
			out[c] = s
		}
	}
	return out
}

// Blob is one blob of a pushed image.
type Blob struct {
	Digest string `json:"digest"`
	Size   int64  `json:"size"`
}

// Image is an image pushed to the registry.
type Image struct {
	// Ref is "<registry address>/<repo>:<tag>", as the testbed's hosts
	// name it.
	Ref string `json:"ref"`
	// Manifest is the image manifest, Config its config and Layers its
	// compressed layers: what a pull transfers.
	Manifest Blob   `json:"manifest"`
	Config   Blob   `json:"config"`
	Layers   []Blob `json:"layers"`
}

// Size is the bytes of the manifest, the config and the layers.
func (img Image) Size() int64 {
	n := img.Manifest.Size + img.Config.Size
	for _, l := range img.Layers {
		n += l.Size
	}
	return n
}

// Blobs lists the manifest, the config and the layers.
func (img Image) Blobs() []Blob { return append([]Blob{img.Manifest, img.Config}, img.Layers...) }

// pushRequest asks the registry's server to push a random image.
type pushRequest struct {
	Repo      string `json:"repo"`
	Tag       string `json:"tag"`
	Layers    int    `json:"layers"`
	LayerSize int64  `json:"layer_size"`
}

// Registry is an OCI registry (Debian's docker-registry) running in a host
// of the testbed behind a proxy that counts its blob traffic by client.
type Registry struct {
	// Addr is host:port of the registry on its host's address, plain HTTP.
	Addr string

	control string
	stop    func()
}

// StartRegistry runs the registry in host h, its storage under dir,
// listening on addr (h's address and a port), and waits (10 s at most)
// until it answers on its control socket. The bench re-executes itself
// there: exe must call ServeRegistry when run with
// "-serve-registry DIR -listen ADDR -control SOCKET". Close stops it.
func StartRegistry(ctx context.Context, h *testbed.Host, exe, dir, addr, control string) (*Registry, error) {
	r := &Registry{Addr: addr, control: control}
	var err error
	r.stop, err = startServer(ctx, h, "registry", exe, []string{"-serve-registry", dir, "-listen", addr, "-control", control},
		func(ctx context.Context) error {
			_, err := r.Traffic(ctx)
			return err
		})
	if err != nil {
		return nil, err
	}
	return r, nil
}

// Close stops the registry (SIGTERM) and waits.
func (r *Registry) Close() { r.stop() }

// Traffic returns the registry's blob traffic since it started.
func (r *Registry) Traffic(ctx context.Context) (RegistryTraffic, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b, err := controlCall(ctx, r.control, http.MethodGet, "/traffic", nil)
	if err != nil {
		return nil, fmt.Errorf("asking the registry for its traffic: %w", err)
	}
	var t RegistryTraffic
	return t, json.Unmarshal(b, &t)
}

// Push pushes an image of layers gzip tar layers, each one file of
// layerSize random (incompressible) bytes, as repo:tag. The registry's
// server pushes it to docker-registry over its own loopback, so the push
// crosses no shaped link and is not counted in Traffic.
func (r *Registry) Push(ctx context.Context, repo, tag string, layers int, layerSize int64) (Image, error) {
	req, err := json.Marshal(pushRequest{Repo: repo, Tag: tag, Layers: layers, LayerSize: layerSize})
	if err != nil {
		return Image{}, err
	}
	b, err := controlCall(ctx, r.control, http.MethodPost, "/push", req)
	if err != nil {
		return Image{}, fmt.Errorf("pushing %s:%s: %w", repo, tag, err)
	}
	var img Image
	return img, json.Unmarshal(b, &img)
}

// blobPath matches the path of a blob request.
var blobPath = regexp.MustCompile(`^/v2/.+/blobs/[a-z0-9]+:[a-f0-9]+$`)

// ServeRegistry runs docker-registry (internal/services) with its storage
// under dir, inside the registry host, and a reverse proxy in front of it
// on listen that counts the body bytes of blob GETs by client, until
// SIGTERM or SIGINT. Its control socket answers GET /traffic with the
// counts (RegistryTraffic) and POST /push with an Image it pushed.
func ServeRegistry(dir, listen, control string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	reg, err := services.StartRegistry(ctx, services.RegistryConfig{Dir: dir})
	if err != nil {
		return err
	}
	defer reg.Close()
	// Straight to docker-registry, past services' own counting proxy: one
	// user-space copy is enough.
	upstream := &url.URL{Scheme: "http", Host: reg.DirectAddr()}
	proxy := &httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) {
		pr.SetURL(upstream)
		pr.Out.Host = pr.In.Host // the registry's URLs name the address clients use
	}}
	counts := &trafficCounter{t: make(RegistryTraffic)}
	srv := &http.Server{Handler: counts.wrap(proxy), ReadHeaderTimeout: 10 * time.Second}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /traffic", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(counts.snapshot())
	})
	mux.HandleFunc("POST /push", func(w http.ResponseWriter, r *http.Request) {
		var req pushRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		img, err := push(r.Context(), reg.DirectAddr(), listen, req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(img)
	})
	cs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}

	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	cln, err := net.Listen("unix", control)
	if err != nil {
		ln.Close()
		return err
	}
	g, ctx := errgroup.WithContext(ctx)
	for _, s := range []struct {
		srv *http.Server
		ln  net.Listener
	}{{srv, ln}, {cs, cln}} {
		g.Go(func() error {
			if err := s.srv.Serve(s.ln); !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		})
	}
	g.Go(func() error {
		<-ctx.Done()
		return errors.Join(srv.Close(), cs.Close())
	})
	err = g.Wait()
	var sent int64
	for _, x := range counts.snapshot().ByClient() {
		sent += x.BlobBytes
	}
	fmt.Fprintf(os.Stderr, "served %d blob bytes\n", sent)
	if err != nil {
		err = fmt.Errorf("%w; docker-registry's log ends:\n%s", err, reg.LogTail())
	}
	return err
}

// push pushes a random image to docker-registry at direct and describes it
// as the testbed's hosts see it, at public.
func push(ctx context.Context, direct, public string, req pushRequest) (Image, error) {
	pushed, err := services.PushRandomImage(ctx, direct, req.Repo, req.Tag, req.Layers, req.LayerSize, nil)
	if err != nil {
		return Image{}, err
	}
	m, err := pushed.Image.Manifest()
	if err != nil {
		return Image{}, err
	}
	raw, err := pushed.Image.RawManifest()
	if err != nil {
		return Image{}, err
	}
	img := Image{
		Ref:      public + "/" + req.Repo + ":" + req.Tag,
		Manifest: Blob{Digest: pushed.Digest.String(), Size: int64(len(raw))},
		Config:   Blob{Digest: m.Config.Digest.String(), Size: m.Config.Size},
	}
	for _, l := range m.Layers {
		img.Layers = append(img.Layers, Blob{Digest: l.Digest.String(), Size: l.Size})
	}
	return img, nil
}

// trafficCounter counts blob traffic by client address and client.
type trafficCounter struct {
	mu sync.Mutex
	t  RegistryTraffic
}

func (c *trafficCounter) add(addr, client string, gets, bytes int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.t[addr]
	if m == nil {
		m = make(map[string]Traffic)
		c.t[addr] = m
	}
	x := m[client]
	x.BlobGets += gets
	x.BlobBytes += bytes
	m[client] = x
}

func (c *trafficCounter) snapshot() RegistryTraffic {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(RegistryTraffic, len(c.t))
	for addr, m := range c.t {
		out[addr] = make(map[string]Traffic, len(m))
		for client, x := range m {
			out[addr][client] = x
		}
	}
	return out
}

// wrap counts the blob GETs that h answers.
func (c *trafficCounter) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet || !blobPath.MatchString(r.URL.Path) {
			h.ServeHTTP(w, r)
			return
		}
		addr, _, err := net.SplitHostPort(r.RemoteAddr)
		if err != nil {
			addr = r.RemoteAddr
		}
		client := clientOf(r.UserAgent())
		c.add(addr, client, 1, 0)
		h.ServeHTTP(&countingResponse{ResponseWriter: w, add: func(n int64) { c.add(addr, client, 0, n) }}, r)
	})
}

// countingResponse counts the body bytes written through it.
type countingResponse struct {
	http.ResponseWriter
	add func(int64)
}

func (w *countingResponse) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	w.add(int64(n))
	return n, err
}

// Unwrap lets http.ResponseController (the reverse proxy's flushes) reach
// the real writer.
func (w *countingResponse) Unwrap() http.ResponseWriter { return w.ResponseWriter }
