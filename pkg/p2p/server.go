package p2p

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/weightd/weightd/pkg/cache"
)

// ChunkStore is what the chunk server reads: the verified chunks of blobs
// the node holds or is downloading. *cache.Store implements it.
type ChunkStore interface {
	ChunkState(d digest.Digest) (cache.ChunkState, error)
	OpenChunk(d digest.Digest, i int) (f *os.File, off, n int64, err error)
}

// The chunk server's routes.
const (
	statePath = "/v1/blobs/%s/state"
	chunkPath = "/v1/blobs/%s/chunks/%d"
)

// sendPiece is how much the server sends per limiter wait: small enough to
// pace smoothly, large enough for sendfile to pay off.
const sendPiece = 256 << 10

// ChunkServer serves verified chunks to peers over HTTP:
//
//	GET /v1/blobs/{digest}/state        which chunks this node has, and their hashes (binary, see EncodeChunkState)
//	GET /v1/blobs/{digest}/chunks/{i}   chunk i, or a byte range of it (Range: bytes=a-b)
//	GET /v1/resolutions/{key}           how a reference resolved (with WithResolutions)
//
// Chunks of blobs still downloading are served as soon as they are verified.
// Bytes go from the blob file to the socket with sendfile, paced by the
// upload limit. Unknown or unverified content is 404, a malformed digest or
// index 400; no path is derived from anything but a validated digest.
type ChunkServer struct {
	store       ChunkStore
	origin      func(digest.Digest) bool // whether this node fetches d from the origin
	slots       chan struct{}            // chunk uploads at once; nil for no limit
	resolutions *Resolutions             // nil: none served
	upload      *rate.Limiter
	log         *slog.Logger
	m           *serverMetrics
}

type serverMetrics struct {
	servedBytes prometheus.Counter
	requests    *prometheus.CounterVec
}

// ServerOption configures a ChunkServer.
type ServerOption func(*ChunkServer)

// WithUploadLimit caps the bytes per second the server sends, all peers
// together, so sharing does not starve inference traffic. 0 means no limit.
func WithUploadLimit(bytesPerSecond int64) ServerOption {
	return func(s *ChunkServer) { s.upload = newLimiter(bytesPerSecond) }
}

// WithMaxUploads caps the chunk uploads served at once; a request beyond it
// gets 503 at once and its client asks another peer. Fewer, faster uploads
// pass each chunk on sooner. 0 means no limit.
func WithMaxUploads(n int) ServerOption {
	return func(s *ChunkServer) {
		if n > 0 {
			s.slots = make(chan struct{}, n)
		}
	}
}

// WithOriginRole tells peers, in each blob's chunk state, whether this node
// fetches that blob from the origin (Swarm.FetchesFromOrigin): they then
// leave the origin alone and trust this node's chunk hashes first.
func WithOriginRole(fetches func(digest.Digest) bool) ServerOption {
	return func(s *ChunkServer) { s.origin = fetches }
}

// WithResolutions serves r to peers that cannot reach an origin to resolve
// a reference themselves (GET /v1/resolutions/{sha256 of the reference}).
func WithResolutions(r *Resolutions) ServerOption {
	return func(s *ChunkServer) { s.resolutions = r }
}

// WithServerLogger sets the logger; the server is silent by default.
func WithServerLogger(l *slog.Logger) ServerOption { return func(s *ChunkServer) { s.log = l } }

// NewChunkServer returns a server of store's chunks. Its metrics are
// registered on reg (nil for none).
func NewChunkServer(store ChunkStore, reg prometheus.Registerer, opts ...ServerOption) (*ChunkServer, error) {
	s := &ChunkServer{store: store, log: slog.New(slog.DiscardHandler), m: &serverMetrics{
		servedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_p2p_served_bytes_total", Help: "Chunk bytes served to peers.",
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_p2p_server_requests_total", Help: "Chunk server requests by route and status code.",
		}, []string{"route", "code"}),
	}}
	for _, o := range opts {
		o(s)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{s.m.servedBytes, s.m.requests} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("registering chunk server metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Handler returns the server's routes.
func (s *ChunkServer) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/blobs/{digest}/state", s.serveState)
	mux.HandleFunc("GET /v1/blobs/{digest}/chunks/{index}", s.serveChunk)
	if s.resolutions != nil {
		mux.HandleFunc("GET "+resolutionPrefix+"{key}", s.serveResolution)
	}
	return mux
}

// Run serves on ln until ctx is done, then shuts down gracefully.
func (s *ChunkServer) Run(ctx context.Context, ln net.Listener) error {
	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("chunk server: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
	}
	return nil
}

func (s *ChunkServer) serveState(w http.ResponseWriter, r *http.Request) {
	d, err := cache.ParseDigest(r.PathValue("digest"))
	if err != nil {
		s.fail(w, "state", http.StatusBadRequest, err)
		return
	}
	st, err := s.store.ChunkState(d)
	if err != nil {
		s.fail(w, "state", statusOf(err), err)
		return
	}
	b := EncodeChunkState(st, s.origin != nil && s.origin(d))
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Write(b)
	s.m.requests.WithLabelValues("state", "200").Inc()
}

func (s *ChunkServer) serveChunk(w http.ResponseWriter, r *http.Request) {
	d, err := cache.ParseDigest(r.PathValue("digest"))
	if err != nil {
		s.fail(w, "chunk", http.StatusBadRequest, err)
		return
	}
	i, err := strconv.Atoi(r.PathValue("index"))
	if err != nil || i < 0 || strconv.Itoa(i) != r.PathValue("index") {
		s.fail(w, "chunk", http.StatusBadRequest, fmt.Errorf("chunk index %q", r.PathValue("index")))
		return
	}
	if s.slots != nil {
		select {
		case s.slots <- struct{}{}:
			defer func() { <-s.slots }()
		default:
			s.fail(w, "chunk", http.StatusServiceUnavailable, errors.New("all upload slots busy"))
			return
		}
	}
	f, off, n, err := s.store.OpenChunk(d, i)
	if err != nil {
		s.fail(w, "chunk", statusOf(err), err)
		return
	}
	defer f.Close()
	code := http.StatusOK
	if h := r.Header.Get("Range"); h != "" {
		start, end, ok := parseRange(h, n)
		if !ok {
			w.Header().Set("Content-Range", fmt.Sprintf("bytes */%d", n))
			s.fail(w, "chunk", http.StatusRequestedRangeNotSatisfiable, fmt.Errorf("range %q of a %d-byte chunk", h, n))
			return
		}
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, end-1, n))
		off, n, code = off+start, end-start, http.StatusPartialContent
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		s.fail(w, "chunk", http.StatusInternalServerError, err)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	w.WriteHeader(code)
	s.m.requests.WithLabelValues("chunk", strconv.Itoa(code)).Inc()
	for n > 0 {
		k := min(n, sendPiece)
		if s.upload != nil {
			if err := s.upload.WaitN(r.Context(), int(k)); err != nil {
				return
			}
		}
		// io.CopyN wraps f in an io.LimitedReader, which net/http hands to
		// sendfile: the bytes go from the page cache to the socket.
		sent, err := io.CopyN(w, f, k)
		s.m.servedBytes.Add(float64(sent))
		if err != nil {
			s.log.Debug("chunk upload ended early", "digest", d, "chunk", i, "err", err)
			return
		}
		n -= sent
	}
}

func (s *ChunkServer) fail(w http.ResponseWriter, route string, code int, err error) {
	s.m.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
	http.Error(w, err.Error(), code)
}

func statusOf(err error) int {
	switch {
	case errors.Is(err, cache.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, cache.ErrInvalid):
		return http.StatusBadRequest
	default:
		return http.StatusInternalServerError
	}
}

// parseRange parses a single "bytes=a-b", "bytes=a-" or "bytes=-n" range of
// a resource of size n into [start, end).
func parseRange(h string, n int64) (start, end int64, ok bool) {
	spec, found := strings.CutPrefix(h, "bytes=")
	if !found || strings.Contains(spec, ",") {
		return 0, 0, false
	}
	a, b, found := strings.Cut(spec, "-")
	if !found {
		return 0, 0, false
	}
	if a == "" {
		suffix, err := strconv.ParseInt(b, 10, 64)
		if err != nil || suffix <= 0 {
			return 0, 0, false
		}
		return max(0, n-suffix), n, true
	}
	start, err := strconv.ParseInt(a, 10, 64)
	if err != nil || start < 0 || start >= n {
		return 0, 0, false
	}
	end = n
	if b != "" {
		last, err := strconv.ParseInt(b, 10, 64)
		if err != nil || last < start {
			return 0, 0, false
		}
		end = min(last+1, n)
	}
	return start, end, true
}

// Chunk state wire format, all integers big-endian:
//
//	magic "WDCS" | version 1 | flags (bit 0: complete, bit 1: fetching from the origin) | size uint64 | chunk size uint64 |
//	have bitmap (ceil(chunks/8) bytes, bit i LSB-first = chunk i) | sha256 of each present chunk, in order
const (
	chunkStateMagic      = "WDCS"
	chunkStateVersion    = 1
	chunkStateHeaderSize = 4 + 1 + 1 + 8 + 8
	// Bounds on what a peer may claim: a blob of at most 16 TiB, chunks of
	// 64 KiB to 1 GiB, at most 16 Mi chunks.
	maxChunkStateSize      = 16 << 40
	minChunkStateChunkSize = 64 << 10
	maxChunkStateChunkSize = 1 << 30
	maxChunkStateChunks    = 16 << 20
)

// EncodeChunkState encodes st for the wire; origin says whether this node
// fetches the blob from the origin.
func EncodeChunkState(st cache.ChunkState, origin bool) []byte {
	n := chunksOf(st.Size, st.ChunkSize)
	b := make([]byte, 0, chunkStateHeaderSize+len(st.Have)+n*32)
	b = append(b, chunkStateMagic...)
	b = append(b, chunkStateVersion, 0)
	if st.Complete {
		b[5] |= 1
	}
	if origin {
		b[5] |= 2
	}
	b = binary.BigEndian.AppendUint64(b, uint64(st.Size))
	b = binary.BigEndian.AppendUint64(b, uint64(st.ChunkSize))
	b = append(b, st.Have...)
	for i := range n {
		if st.Has(i) {
			b = append(b, st.Hash(i)...)
		}
	}
	return b
}

// DecodeChunkState decodes a peer's chunk state and whether it fetches the
// blob from the origin, rejecting anything malformed or out of bounds; it
// never trusts a length it has not checked.
func DecodeChunkState(b []byte) (st cache.ChunkState, origin bool, err error) {
	st, err = decodeChunkState(b)
	if err != nil {
		return cache.ChunkState{}, false, err
	}
	return st, b[5]&2 != 0, nil
}

func decodeChunkState(b []byte) (cache.ChunkState, error) {
	var st cache.ChunkState
	if len(b) < chunkStateHeaderSize || string(b[:4]) != chunkStateMagic {
		return st, errors.New("chunk state: bad header")
	}
	if b[4] != chunkStateVersion {
		return st, fmt.Errorf("chunk state: unknown version %d", b[4])
	}
	if b[5]&^3 != 0 {
		return st, fmt.Errorf("chunk state: unknown flags %#x", b[5])
	}
	size, cs := binary.BigEndian.Uint64(b[6:]), binary.BigEndian.Uint64(b[14:])
	if size > maxChunkStateSize || cs < minChunkStateChunkSize || cs > maxChunkStateChunkSize {
		return st, fmt.Errorf("chunk state: size %d, chunk size %d out of bounds", size, cs)
	}
	n := chunksOf(int64(size), int64(cs))
	if n > maxChunkStateChunks {
		return st, fmt.Errorf("chunk state: %d chunks", n)
	}
	rest := b[chunkStateHeaderSize:]
	if len(rest) < (n+7)/8 {
		return st, errors.New("chunk state: short bitmap")
	}
	st = cache.ChunkState{Size: int64(size), ChunkSize: int64(cs), Complete: b[5]&1 != 0, Have: append([]byte(nil), rest[:(n+7)/8]...)}
	if n%8 != 0 && st.Have[len(st.Have)-1]>>(n%8) != 0 {
		return cache.ChunkState{}, errors.New("chunk state: bits set past the last chunk")
	}
	rest = rest[(n+7)/8:]
	present := 0
	for i := range n {
		if st.Has(i) {
			present++
		}
	}
	if st.Complete && present != n {
		return cache.ChunkState{}, errors.New("chunk state: complete but chunks missing")
	}
	if len(rest) != present*32 {
		return cache.ChunkState{}, fmt.Errorf("chunk state: %d bytes of hashes for %d chunks", len(rest), present)
	}
	st.Hashes = make([]byte, n*32)
	for i := range n {
		if st.Has(i) {
			copy(st.Hashes[i*32:], rest[:32])
			rest = rest[32:]
		}
	}
	return st, nil
}

func chunksOf(size, chunkSize int64) int {
	if chunkSize <= 0 {
		return 0
	}
	return int((size + chunkSize - 1) / chunkSize)
}

// newLimiter returns a token bucket for bytesPerSecond, or nil for none.
func newLimiter(bytesPerSecond int64) *rate.Limiter {
	if bytesPerSecond <= 0 {
		return nil
	}
	return rate.NewLimiter(rate.Limit(bytesPerSecond), int(max(bytesPerSecond/10, 2*sendPiece)))
}
