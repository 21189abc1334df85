package p2p

import (
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/bits"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	ChunkHash(d digest.Digest, i int) ([]byte, error)
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
//	GET /v1/blobs/{digest}/state        which chunks this node has, and their hashes (binary, see EncodePeerState; ?since=K&wait=D waits for news)
//	GET /v1/blobs/{digest}/chunks/{i}   chunk i, or a byte range of it (Range: bytes=a-b)
//	GET /v1/resolutions/{key}           how a reference resolved (with WithResolutions)
//
// Chunks of blobs still downloading are served as soon as they are verified,
// and (WithSwarm) a whole chunk still on its way here is relayed as it
// comes, its last relayPiece only once it is verified here: a peer completes
// only chunks this node verified, and a chunk crosses the swarm in about one
// transfer time instead of one per hop. Bytes go from the blob file to the
// socket with sendfile, paced by the upload limit. Unknown or unverified
// content is 404, a malformed digest or index 400; no path is derived from
// anything but a validated digest.
type ChunkServer struct {
	store       ChunkStore
	swarm       *Swarm        // nil: no origin role told, no chunk relayed
	slots       chan struct{} // chunk uploads at once; nil for no limit
	resolutions *Resolutions  // nil: none served
	sent        sentLog
	repeating   atomic.Bool // an origin fetcher is sending a chunk again
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

// WithSwarm serves what sw, this node's swarm downloader, is doing: in each
// blob's chunk state, whether this node fetches the blob from the origin
// (peers then leave the origin alone and trust its chunk hashes first) and
// which chunks are on their way here (peers then ask for them at once, and
// do not fetch them from the origin); and the chunks on their way, relayed
// as they come.
func WithSwarm(sw *Swarm) ServerOption {
	return func(s *ChunkServer) { s.swarm = sw }
}

// originRole is whether this node fetches d from the origin.
func (s *ChunkServer) originRole(d digest.Digest) bool {
	return s.swarm != nil && s.swarm.FetchesFromOrigin(d)
}

// receiving is the bitmap of d's chunks on their way here, nil if none.
func (s *ChunkServer) receiving(d digest.Digest) []byte {
	if s.swarm == nil {
		return nil
	}
	return s.swarm.live.receiving(d)
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
			Name: "weightd_p2p_server_requests_total", Help: "Chunk server requests by route (state, chunk, relay: a chunk sent while it comes in, resolution) and status code.",
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

// maxStateWait bounds how long a state request may wait for news, and
// statePoll is how often it looks for news meanwhile.
const (
	maxStateWait = 2 * time.Second
	statePoll    = 20 * time.Millisecond
)

// serveState answers with the blob's state. With "?since=K&wait=D" it first
// waits, up to D (at most 2 s), until this node has more than K chunks of the
// blob or holds it whole, or (with "&sent=J") until it has sent other than J
// of them, or (with "&fetching=F", which also asks for the bitmap of chunks
// on their way here) until other than F are on their way, or (with
// "&origin=0|1") until its origin role differs: peers learn of each
// verified chunk, each first send and each chunk on its way within
// milliseconds without polling in a tight loop. With "&known=B"
// (the bitmap of chunks whose hashes the requester has, base64url) it
// leaves those hashes out.
func (s *ChunkServer) serveState(w http.ResponseWriter, r *http.Request) {
	d, err := cache.ParseDigest(r.PathValue("digest"))
	if err != nil {
		s.fail(w, "state", http.StatusBadRequest, err)
		return
	}
	since, wait := -1, time.Duration(0)
	if v := r.URL.Query().Get("since"); v != "" {
		if since, err = strconv.Atoi(v); err != nil || since < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("since %q", v))
			return
		}
	}
	if v := r.URL.Query().Get("wait"); v != "" {
		if wait, err = time.ParseDuration(v); err != nil || wait < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("wait %q", v))
			return
		}
	}
	knownSent := -1
	if v := r.URL.Query().Get("sent"); v != "" {
		if knownSent, err = strconv.Atoi(v); err != nil || knownSent < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("sent %q", v))
			return
		}
	}
	knownFetching := -1
	if v := r.URL.Query().Get("fetching"); v != "" {
		if knownFetching, err = strconv.Atoi(v); err != nil || knownFetching < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("fetching %q", v))
			return
		}
	}
	knownOrigin := r.URL.Query().Get("origin")
	var knownHashes []byte
	if v := r.URL.Query().Get("known"); v != "" {
		if knownHashes, err = base64.RawURLEncoding.DecodeString(v); err != nil {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("known %q", v))
			return
		}
	}
	deadline := time.Now().Add(min(wait, maxStateWait))
	for {
		st, err := s.store.ChunkState(d)
		origin := s.originRole(d)
		sent := s.sent.get(d, st.Have)
		var fetching []byte
		if knownFetching >= 0 {
			// Only to those who ask: agents that predate the fetching
			// bitmap reject a state that has one.
			fetching = notHeld(s.receiving(d), st.Have)
		}
		news := err == nil && (st.Complete || countBits(st.Have) > since ||
			(knownSent >= 0 && countBits(sent) != knownSent) ||
			(knownFetching >= 0 && countBits(fetching) != knownFetching) ||
			(knownOrigin != "" && (knownOrigin == "1") != origin))
		if news || time.Now().After(deadline) {
			if err != nil {
				s.fail(w, "state", statusOf(err), err)
				return
			}
			var known []byte
			if knownHashes != nil {
				if len(knownHashes) != len(st.Have) {
					s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("known: %d bytes for %d chunks", len(knownHashes), chunksOf(st.Size, st.ChunkSize)))
					return
				}
				known = intersect(knownHashes, st.Have)
			}
			b := EncodePeerState(PeerState{ChunkState: st, Origin: origin, Sent: sent, Fetching: fetching, Known: known})
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
			s.m.requests.WithLabelValues("state", "200").Inc()
			if _, err := w.Write(b); err != nil {
				s.log.Debug("sending a chunk state", "digest", d, "err", err)
			}
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-time.After(statePoll):
		}
	}
}

func countBits(b []byte) int {
	n := 0
	for _, x := range b {
		n += bits.OnesCount8(x)
	}
	return n
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
			w.Header().Set(busyHeader, "server")
			s.fail(w, "chunk", http.StatusServiceUnavailable, errors.New("all upload slots busy"))
			return
		}
	}
	// A chunk not verified here yet is relayed if it is on its way (whole
	// chunks only). It stops being on its way once verified and written:
	// if it stopped since the first look, the second finds it.
	f, off, n, err := s.store.OpenChunk(d, i)
	var live *liveChunk
	if errors.Is(err, cache.ErrNotFound) && s.swarm != nil && r.Header.Get("Range") == "" {
		if live = s.swarm.live.open(d, i); live == nil {
			f, off, n, err = s.store.OpenChunk(d, i)
		}
	}
	switch {
	case live != nil:
		defer live.release()
		n = int64(len(live.data()))
	case err != nil:
		s.fail(w, "chunk", statusOf(err), err)
		return
	default:
		defer f.Close()
	}
	// An origin fetcher's upload is the swarm's narrowest pipe: every chunk
	// of its share must leave it once, as fast as the origin sends it. So
	// it sends a chunk once per resendAfter (the first receiver passes it
	// on), but for one repeat at a time while half its upload slots are
	// free: first copies keep most of the link, and the rest is not left
	// idle. Any other node sends a chunk to all who ask, and spreads it
	// sooner.
	if !s.sent.mark(d, i, s.originRole(d)) {
		if s.slots == nil || len(s.slots) > cap(s.slots)/2 || !s.repeating.CompareAndSwap(false, true) {
			w.Header().Set(busyHeader, "chunk")
			s.fail(w, "chunk", http.StatusServiceUnavailable, errors.New("chunk sent already; ask its receiver"))
			return
		}
		defer s.repeating.Store(false)
		s.sent.mark(d, i, false)
	}
	if live != nil {
		s.relay(w, r, live, d, i)
		return
	}
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
	if code == http.StatusOK {
		if sum, err := s.store.ChunkHash(d, i); err == nil {
			w.Header().Set(hashHeader, hex.EncodeToString(sum))
		}
	}
	w.WriteHeader(code)
	s.m.requests.WithLabelValues("chunk", strconv.Itoa(code)).Inc()
	err = s.send(r.Context(), n, func(_, k int64) (int64, error) {
		// io.CopyN wraps f in an io.LimitedReader, which net/http hands to
		// sendfile: the bytes go from the page cache to the socket.
		return io.CopyN(w, f, k)
	})
	if err != nil {
		s.log.Debug("chunk upload ended early", "digest", d, "chunk", i, "err", err)
	}
}

// Headers of a chunk: hashHeader gives the chunk's sha256 (hex), which this
// node verified; relayHeader marks a relayed chunk, whose hash comes as a
// trailer after the last byte, which this node sent once it verified it.
const (
	relayHeader = "Weightd-Relay"
	hashHeader  = "Weightd-Chunk-Sha256"
)

// relay sends chunk i of d while it comes in: its bytes as soon as they
// have come, the last relayPiece once the chunk is verified. If it fails here, the
// response ends short, and the peer drops what it got.
func (s *ChunkServer) relay(w http.ResponseWriter, r *http.Request, c *liveChunk, d digest.Digest, i int) {
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(relayHeader, "1")
	w.Header().Set("Trailer", hashHeader)
	w.WriteHeader(http.StatusOK)
	s.m.requests.WithLabelValues("relay", "200").Inc()
	err := s.send(r.Context(), int64(len(c.data())), func(off, k int64) (int64, error) {
		end, sum, err := c.wait(r.Context(), off)
		if err != nil {
			return 0, err
		}
		if sum != nil {
			w.Header().Set(hashHeader, hex.EncodeToString(sum))
		}
		sent, err := w.Write(c.data()[off:min(end, off+k)])
		if f, ok := w.(http.Flusher); ok && err == nil {
			f.Flush()
		}
		return int64(sent), err
	})
	if err != nil {
		s.log.Debug("chunk relay ended early", "digest", d, "chunk", i, "err", err)
	}
}

// send sends n bytes with next, which sends up to k bytes from offset
// off, at most a sendPiece at a time, paced by the upload limit.
func (s *ChunkServer) send(ctx context.Context, n int64, next func(off, k int64) (int64, error)) error {
	for off := int64(0); off < n; {
		sent, err := next(off, min(n-off, sendPiece))
		s.m.servedBytes.Add(float64(sent))
		if err != nil {
			return err
		}
		off += sent
		if s.upload != nil {
			if err := s.upload.WaitN(ctx, int(sent)); err != nil {
				return err
			}
		}
	}
	return nil
}

// busyHeader says, on a 503, whether the chunk or the whole server is busy.
const busyHeader = "Weightd-Busy"

type chunkKey struct {
	d digest.Digest
	i int
}

// resendAfter is how long an origin fetcher waits before it sends a chunk
// again: long enough for the first receiver to have passed it on, short
// enough to recover soon from a receiver that died.
const resendAfter = 10 * time.Second

// sentLog remembers which chunks of the most recent blobs this server has
// sent to some peer, and when it last sent those it sends only once per
// resendAfter.
type sentLog struct {
	mu     sync.Mutex
	m      map[digest.Digest][]byte
	order  []digest.Digest        // oldest first
	recent map[chunkKey]time.Time // sent once, less than resendAfter ago
}

// maxSentBlobs bounds the blobs a sentLog remembers.
const maxSentBlobs = 256

// mark records that chunk i of d is being sent. With once it refuses
// (false) a chunk sent with once less than resendAfter ago.
func (l *sentLog) mark(d digest.Digest, i int, once bool) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	for k, at := range l.recent {
		if now.Sub(at) >= resendAfter {
			delete(l.recent, k)
		}
	}
	if once {
		if _, sent := l.recent[chunkKey{d, i}]; sent {
			return false
		}
		if l.recent == nil {
			l.recent = make(map[chunkKey]time.Time)
		}
		l.recent[chunkKey{d, i}] = now
	}
	if l.m == nil {
		l.m = make(map[digest.Digest][]byte)
	}
	b, ok := l.m[d]
	if !ok {
		l.order = append(l.order, d)
		if len(l.order) > maxSentBlobs {
			delete(l.m, l.order[0])
			l.order = l.order[1:]
		}
	}
	l.m[d] = setBit(b, i, true)
	return true
}

// get returns the sent bitmap of d shaped like have (and a subset of it),
// or nil when nothing was sent.
func (l *sentLog) get(d digest.Digest, have []byte) []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.m[d]
	if !ok {
		return nil
	}
	return intersect(b, have)
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
