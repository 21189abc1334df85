package genmodel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Fault is a misbehaviour of the server, injected into responses.
type Fault struct {
	// Path limits the fault to one file, as a slash-separated path relative
	// to the served directory ("model.safetensors"); empty means every file.
	Path string
	// After is, for stalls and drops, how many body bytes a response sends
	// before the fault strikes; for corruption, the offset in the file of the
	// byte that is flipped.
	After int64
	// Times is how many responses the fault strikes, after which the server
	// behaves; 0 or less means every response.
	Times int
}

// fault is a Fault with its remaining strikes.
type fault struct {
	Fault
	left atomic.Int64
}

func newFault(f Fault) *fault {
	x := &fault{Fault: f}
	x.left.Store(int64(f.Times))
	return x
}

func (f *fault) applies(name string) bool {
	return f != nil && (f.Path == "" || f.Path == name)
}

// strike uses up one of the fault's strikes; false once there are none left.
func (f *fault) strike() bool {
	if f.Times <= 0 {
		return true
	}
	for {
		n := f.left.Load()
		if n <= 0 {
			return false
		}
		if f.left.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// ServerOption configures a Server.
type ServerOption func(*Server)

// WithBandwidth limits the server's total sending rate, over all
// connections, to bytesPerSecond (0: unlimited).
func WithBandwidth(bytesPerSecond int64) ServerOption {
	return func(s *Server) {
		if bytesPerSecond > 0 {
			s.limiter = &limiter{rate: float64(bytesPerSecond)}
		}
	}
}

// WithStall makes responses stop sending after f.After body bytes, keeping
// the connection open, until the client gives up or the server stops.
func WithStall(f Fault) ServerOption { return func(s *Server) { s.stall = newFault(f) } }

// WithDrop makes responses break off after f.After body bytes: the
// connection is closed mid-body.
func WithDrop(f Fault) ServerOption { return func(s *Server) { s.drop = newFault(f) } }

// WithCorrupt flips the bits of the byte at offset f.After of the file in
// responses that include it (whole files and single ranges).
func WithCorrupt(f Fault) ServerOption { return func(s *Server) { s.corrupt = newFault(f) } }

// WithoutRanges makes the server ignore Range headers and always send whole
// files with 200, like some origins do.
func WithoutRanges() ServerOption { return func(s *Server) { s.noRanges = true } }

// Server serves the files of a directory over HTTP, GET and HEAD only, with
// Range support (http.ServeContent; sendfile on Linux when no fault or
// bandwidth limit is set). Paths are confined to the directory (os.Root);
// directories are not listed. Server is also an http.Handler, for use with
// httptest.
type Server struct {
	ln  net.Listener
	dir string

	limiter              *limiter
	stall, drop, corrupt *fault
	noRanges             bool
	served, requests     atomic.Int64
	stopCtx              context.Context // ended when Run stops, to release stalled and paced responses
	stop                 context.CancelFunc
}

// NewServer returns a server of dir on ln. It starts nothing: call Run, or use
// the Server as a handler (ln may then be nil, and URL and Run are not used).
func NewServer(ln net.Listener, dir string, opts ...ServerOption) *Server {
	s := &Server{ln: ln, dir: dir}
	s.stopCtx, s.stop = context.WithCancel(context.Background())
	for _, o := range opts {
		o(s)
	}
	return s
}

// URL returns the server's base URL, "http://host:port".
func (s *Server) URL() string { return "http://" + s.ln.Addr().String() }

// BytesServed returns how many body bytes the server has sent, over all
// responses: the origin's egress.
func (s *Server) BytesServed() int64 { return s.served.Load() }

// Requests returns how many requests the server has received.
func (s *Server) Requests() int64 { return s.requests.Load() }

// Run serves until ctx ends, then shuts down: stalled and paced responses are
// cut off, the others get up to 5 seconds to finish. It may be called once.
func (s *Server) Run(ctx context.Context) error {
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(s.ln) }()
	select {
	case err := <-errc:
		s.stop()
		return fmt.Errorf("serving origin on %s: %w", s.ln.Addr(), err)
	case <-ctx.Done():
	}
	s.stop()
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		srv.Close()
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving origin on %s: %w", s.ln.Addr(), err)
	}
	return nil
}

// ServeHTTP serves one file of the directory.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	name := strings.TrimPrefix(path.Clean("/"+r.URL.Path), "/")
	if name == "" {
		http.NotFound(w, r)
		return
	}
	f, err := os.OpenInRoot(s.dir, name) // no escape, symlinks included
	if err != nil {
		http.NotFound(w, r)
		return
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		http.NotFound(w, r)
		return
	}
	if s.noRanges {
		r.Header.Del("Range")
		r.Header.Del("If-Range")
	}
	if strings.HasSuffix(name, ".json") {
		w.Header().Set("Content-Type", "application/json")
	} else {
		w.Header().Set("Content-Type", "application/octet-stream")
	}

	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(s.stopCtx, cancel)()

	var cw http.ResponseWriter = &countingWriter{ResponseWriter: w, n: &s.served}
	if s.limiter != nil || s.stall.applies(name) || s.drop.applies(name) || s.corrupt.applies(name) {
		cw = &faultWriter{ResponseWriter: w, s: s, ctx: ctx, name: name}
	}
	http.ServeContent(cw, r.WithContext(ctx), name, fi.ModTime(), f)
}

// countingWriter counts body bytes and keeps the ResponseWriter's ReadFrom,
// so that files still go out with sendfile.
type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (w *countingWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	w.n.Add(int64(n))
	return n, err
}

func (w *countingWriter) ReadFrom(r io.Reader) (int64, error) {
	var (
		n   int64
		err error
	)
	if rf, ok := w.ResponseWriter.(io.ReaderFrom); ok {
		n, err = rf.ReadFrom(r)
	} else {
		n, err = io.Copy(struct{ io.Writer }{w.ResponseWriter}, r)
	}
	w.n.Add(n)
	return n, err
}

func (w *countingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// faultWriter sends the body in small pieces, paced by the server's limiter,
// and injects the server's faults.
type faultWriter struct {
	http.ResponseWriter
	s    *Server
	ctx  context.Context
	name string

	wroteHeader bool
	start       int64 // offset in the file of the first body byte
	n           int64 // body bytes sent
}

func (w *faultWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *faultWriter) WriteHeader(code int) {
	if w.wroteHeader {
		return
	}
	w.wroteHeader = true
	if code == http.StatusPartialContent {
		// "bytes first-last/total", as ServeContent writes it for one range.
		cr := strings.TrimPrefix(w.Header().Get("Content-Range"), "bytes ")
		first, _, _ := strings.Cut(cr, "-")
		if off, err := strconv.ParseInt(first, 10, 64); err == nil {
			w.start = off
		} else {
			w.start = -1 // multipart: no single offset, never corrupted
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *faultWriter) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	const piece = 32 << 10
	s := w.s
	written := 0
	for len(p) > 0 {
		b := p[:min(len(p), piece)]
		for _, f := range []*fault{s.stall, s.drop} {
			if !f.applies(w.name) {
				continue
			}
			if w.n < f.After && w.n+int64(len(b)) > f.After {
				b = b[:f.After-w.n]
			}
			if w.n == f.After && f.strike() {
				_ = http.NewResponseController(w.ResponseWriter).Flush()
				if f == s.drop {
					panic(http.ErrAbortHandler) // closes the connection mid-body
				}
				<-w.ctx.Done()
				return written, fmt.Errorf("stalled: %w", w.ctx.Err())
			}
		}
		if c := s.corrupt; c.applies(w.name) && w.start >= 0 {
			if i := c.After - (w.start + w.n); i >= 0 && i < int64(len(b)) && c.strike() {
				b = append([]byte(nil), b...)
				b[i] ^= 0xff
			}
		}
		if s.limiter != nil {
			if err := s.limiter.wait(w.ctx, len(b)); err != nil {
				return written, err
			}
		}
		n, err := w.ResponseWriter.Write(b)
		w.n += int64(n)
		written += n
		s.served.Add(int64(n))
		if err != nil {
			return written, err
		}
		p = p[n:]
	}
	return written, nil
}

// limiter paces sends to a rate shared by all responses.
type limiter struct {
	rate float64 // bytes per second

	mu   sync.Mutex
	next time.Time // when the bytes reserved so far have been sent
}

// wait reserves n bytes of the rate and sleeps until they are due.
func (l *limiter) wait(ctx context.Context, n int) error {
	l.mu.Lock()
	now := time.Now()
	if l.next.Before(now) {
		l.next = now
	}
	l.next = l.next.Add(time.Duration(float64(n) / l.rate * float64(time.Second)))
	due := l.next
	l.mu.Unlock()
	t := time.NewTimer(time.Until(due))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
