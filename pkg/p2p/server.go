package p2p

import (
	"context"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/weightd/weightd/internal/byterange"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// ChunkStore is what the chunk server reads: the verified chunks of blobs
// the node holds or is downloading. *cache.Store implements it.
type ChunkStore interface {
	ChunkState(d digest.Digest) (cache.ChunkState, error)
	ChunkHash(d digest.Digest, i int) ([]byte, error)
	OpenChunk(d digest.Digest, i int) (f *os.File, off, n int64, err error)
}

// chunkMapper is a ChunkStore that can say which chunks of a blob it has
// without copying their hashes (*cache.Store can): while a state request
// waits for news, the server looks every statePoll, and ChunkState copies
// the whole hash list, 32 bytes a chunk, 512 MiB for the largest blob.
// The answer still comes from ChunkState, once.
type chunkMapper interface {
	ChunkMap(d digest.Digest, buf []byte) (have []byte, complete bool, err error)
}

// The chunk server's routes.
const (
	statePath = "/v1/blobs/%s/state"
	chunkPath = "/v1/blobs/%s/chunks/%d"
)

// sendPiece is how much the server sends per limiter wait: small enough to
// pace smoothly, large enough for sendfile to pay off.
const sendPiece = 256 << 10

// writeStall bounds each write to a peer: a sendPiece of a chunk, a state,
// an error. A peer that does not take a sendPiece within it (25 KiB/s; an
// honest one gives up below 256 KiB/s) or never reads at all would hold an
// upload slot for as long as it likes: six such readers held every slot
// of an agent, and no honest peer got a chunk from it. Its connection is
// reset instead, which also frees the kernel's buffers of it at once.
const writeStall = 10 * time.Second

// maxStateWaitsPerPeer bounds the state requests of one peer address that
// wait for news at once; beyond it they are answered at once. An honest
// peer has one in flight per blob it downloads.
const maxStateWaitsPerPeer = 32

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
// socket with sendfile, paced by the upload limit (with WithTLS they are
// encrypted in this process: Go's TLS has no kernel TLS, so there is no
// sendfile then). Unknown or unverified
// content is 404, a malformed digest or index 400; no path is derived from
// anything but a validated digest.
type ChunkServer struct {
	store       ChunkStore
	swarm       *Swarm // nil: no origin role told, no chunk relayed
	slots       int    // upload slots (SlotsHeld); 0 for no limit
	perPeer     int    // chunk uploads at once to one peer address, with slots
	peersMu     sync.Mutex
	uploads     map[*upload]struct{} // uploads in progress, with slots
	peerSlots   map[string]int       // peer address → uploads it has in progress
	sentBytes   atomic.Int64         // chunk bytes sent, for uplink
	uplink      paceMeter
	peerWaits   map[string]int // peer address → state requests waiting for news
	resolutions *Resolutions   // nil: none served
	tls         *tls.Config    // nil: plain HTTP
	sent        sentLog
	repeating   atomic.Bool // an origin fetcher is sending a chunk again
	upload      *rate.Limiter
	log         *slog.Logger
	m           *serverMetrics
}

type serverMetrics struct {
	servedBytes prometheus.Counter
	requests    *prometheus.CounterVec
	lentSlots   prometheus.Counter
}

// ServerOption configures a ChunkServer.
type ServerOption func(*ChunkServer)

// WithUploadLimit caps the bytes per second the server sends, all peers
// together, so sharing does not starve inference traffic. 0 means no limit.
func WithUploadLimit(bytesPerSecond int64) ServerOption {
	return func(s *ChunkServer) { s.upload = newLimiter(bytesPerSecond) }
}

// WithMaxUploads caps the chunk uploads served at once at n slots; a
// request beyond it gets 503 at once and its client asks another peer.
// Fewer, faster uploads pass each chunk on sooner. An upload whose reader
// is slow lends its slot (SlotsHeld), up to 2n uploads in all. 0 means no
// limit. One peer address may hold at most half of the slots, rounded up
// (see WithMaxUploadsPerPeer), so that a peer that hogs them, slow or
// hostile, leaves the others theirs.
func WithMaxUploads(n int) ServerOption {
	return func(s *ChunkServer) { s.slots = max(0, n) }
}

// WithMaxUploadsPerPeer caps the upload slots (WithMaxUploads) one peer
// address holds at once; beyond it, its requests get 503 at once. 0 means
// half the slots, rounded up.
func WithMaxUploadsPerPeer(n int) ServerOption {
	return func(s *ChunkServer) { s.perPeer = max(0, n) }
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

// countReceiving is how many of d's chunks on their way here have lacks.
func (s *ChunkServer) countReceiving(d digest.Digest, have []byte) int {
	if s.swarm == nil {
		return 0
	}
	return s.swarm.live.countReceiving(d, have)
}

// WithResolutions serves r to peers that cannot reach an origin to resolve
// a reference themselves (GET /v1/resolutions/{sha256 of the reference}).
func WithResolutions(r *Resolutions) ServerOption {
	return func(s *ChunkServer) { s.resolutions = r }
}

// WithTLS serves over TLS with cfg (peertls.Identity.ServerConfig, which
// requires every peer's certificate from the cluster's CA), HTTP/1.1 only.
// A connection without a valid peer certificate fails its handshake and
// gets no answer at all.
func WithTLS(cfg *tls.Config) ServerOption { return func(s *ChunkServer) { s.tls = cfg } }

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
		lentSlots: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_p2p_upload_slots_lent_total", Help: "Chunk uploads started beyond --max-uploads, on a slot lent by an upload whose reader is slow.",
		}),
	}}
	for _, o := range opts {
		o(s)
	}
	if s.slots > 0 && s.perPeer == 0 {
		s.perPeer = (s.slots + 1) / 2
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{s.m.servedBytes, s.m.requests, s.m.lentSlots} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("registering chunk server metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Handler returns the server's routes. Every answer's writes are bounded
// by writeStall, and so is the end of the answer once the route is done.
func (s *ChunkServer) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/blobs/{digest}/state", s.serveState)
	mux.HandleFunc("GET /v1/blobs/{digest}/chunks/{index}", s.serveChunk)
	if s.resolutions != nil {
		mux.HandleFunc("GET "+resolutionPrefix+"{key}", s.serveResolution)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		extendWrite(w)
		defer extendWrite(w) // the rest of the answer leaves after the route returns
		mux.ServeHTTP(w, r)
	})
}

// extendWrite gives the writes of w writeStall from now. Its error is
// ignored: a writer without deadlines (a test's recorder) has none to set.
func extendWrite(w http.ResponseWriter) {
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(writeStall))
}

// connKey carries a request's connection in its context (Run), so that a
// peer too slow to read is cut off.
type connKey struct{}

// cut resets the connection of r, a peer that took no sendPiece within
// writeStall: its upload slot is free already, and the kernel drops the
// bytes queued for it now rather than trickle them out for hours.
func (s *ChunkServer) cut(r *http.Request) {
	c, _ := r.Context().Value(connKey{}).(net.Conn)
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	if c, ok := c.(*net.TCPConn); ok {
		_ = c.SetLinger(0)
		_ = c.Close()
	}
}

// peerOf is the address of the peer that sent r, without its port.
func peerOf(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

// takeSlot takes an upload slot for peer: none while it holds its share,
// or all are held (SlotsHeld) or 2 × slots uploads run. The upload when it
// got one (give it back with releaseSlot), else why not.
func (s *ChunkServer) takeSlot(peer string, chunk chunkKey) (*upload, string) {
	s.peersMu.Lock()
	defer s.peersMu.Unlock()
	if s.peerSlots[peer] >= s.perPeer {
		return nil, "this peer holds its share of the upload slots"
	}
	if len(s.uploads) >= 2*s.slots || s.slotsHeldLocked() >= s.slots {
		return nil, "all upload slots busy"
	}
	if s.uploads == nil {
		s.uploads, s.peerSlots = map[*upload]struct{}{}, map[string]int{}
	}
	if len(s.uploads) >= s.slots {
		s.m.lentSlots.Inc()
	}
	u := &upload{peer: peer, chunk: chunk, began: time.Now()}
	s.uploads[u] = struct{}{}
	s.peerSlots[peer]++
	return u, ""
}

// sendsOnce reports whether up's chunk is one that this server, holding
// its blob whole, sends once while it moves (SendsOnce). Only sends to
// members count: a member relays the chunk as it comes, and a client
// that is none could otherwise keep chunks from everyone by asking for
// them and reading slowly.
func (s *ChunkServer) sendsOnce(up *upload) bool {
	m, ok := s.store.(chunkMapper)
	if !ok || s.swarm == nil || s.swarm.dir == nil {
		return false
	}
	s.peersMu.Lock()
	var same []*upload
	for u := range s.uploads {
		if u != up && u.chunk == up.chunk {
			same = append(same, u)
		}
	}
	now := time.Now()
	held, uplink := s.slotsHeldLocked(), s.uplink.observe(now, s.sentBytes.Load())
	s.peersMu.Unlock()
	if len(same) == 0 {
		return false
	}
	if _, complete, err := m.ChunkMap(up.chunk.d, nil); err != nil || !complete {
		return false
	}
	members := s.membersByHost()
	var sending []Upload
	for _, u := range same {
		if _, member := members[u.peer]; member {
			sending = append(sending, Upload{Sent: u.sent.Load(), Size: u.size.Load(), Running: now.Sub(u.began)})
		}
	}
	return SendsOnce(sending, held, s.slots, uplink)
}

// slotsHeld is SlotsHeld of the uploads in progress.
func (s *ChunkServer) slotsHeld() int {
	s.peersMu.Lock()
	defer s.peersMu.Unlock()
	return s.slotsHeldLocked()
}

// slotsHeldLocked is SlotsHeld of the uploads in progress; peersMu is held.
func (s *ChunkServer) slotsHeldLocked() int {
	now := time.Now()
	ups := make([]Upload, 0, len(s.uploads))
	for u := range s.uploads {
		ups = append(ups, Upload{Sent: u.sent.Load(), Size: u.size.Load(), Running: now.Sub(u.began)})
	}
	return SlotsHeld(ups, s.uplink.observe(now, s.sentBytes.Load()), s.slots)
}

func (s *ChunkServer) releaseSlot(u *upload) {
	s.peersMu.Lock()
	defer s.peersMu.Unlock()
	delete(s.uploads, u)
	if s.peerSlots[u.peer]--; s.peerSlots[u.peer] <= 0 {
		delete(s.peerSlots, u.peer)
	}
}

// mayWait reports whether a state request of peer may wait for news,
// and counts it until done is called.
func (s *ChunkServer) mayWait(peer string) (ok bool, done func()) {
	s.peersMu.Lock()
	defer s.peersMu.Unlock()
	if s.peerWaits[peer] >= maxStateWaitsPerPeer {
		return false, func() {}
	}
	if s.peerWaits == nil {
		s.peerWaits = map[string]int{}
	}
	s.peerWaits[peer]++
	return true, func() {
		s.peersMu.Lock()
		defer s.peersMu.Unlock()
		if s.peerWaits[peer]--; s.peerWaits[peer] <= 0 {
			delete(s.peerWaits, peer)
		}
	}
}

// Run serves on ln until ctx is done, then shuts down gracefully.
func (s *ChunkServer) Run(ctx context.Context, ln net.Listener) error {
	if s.tls != nil {
		ln = tls.NewListener(ln, s.tls)
	}
	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute,
		MaxHeaderBytes: 64 << 10, // a state request's known bitmap takes 3 KiB
		// Failed handshakes (anyone may knock) and the like, to the log at debug.
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, c)
		}}
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

func (s *ChunkServer) serveChunk(w http.ResponseWriter, r *http.Request) {
	d, err := content.ParseDigest(r.PathValue("digest"))
	if err != nil {
		s.fail(w, "chunk", http.StatusBadRequest, err)
		return
	}
	i, err := strconv.Atoi(r.PathValue("index"))
	if err != nil || i < 0 || strconv.Itoa(i) != r.PathValue("index") {
		s.fail(w, "chunk", http.StatusBadRequest, fmt.Errorf("chunk index %q", r.PathValue("index")))
		return
	}
	var up *upload // nil without slots
	if s.slots > 0 {
		var busy string
		if up, busy = s.takeSlot(peerOf(r), chunkKey{d, i}); up == nil {
			w.Header().Set(busyHeader, "server")
			s.fail(w, "chunk", http.StatusServiceUnavailable, errors.New(busy))
			return
		}
		defer s.releaseSlot(up)
		if s.sendsOnce(up) {
			w.Header().Set(busyHeader, "chunk")
			s.fail(w, "chunk", http.StatusServiceUnavailable, errors.New("chunk on its way to another peer; ask its receiver"))
			return
		}
	}
	// A chunk not verified here yet is relayed if it is on its way (whole
	// chunks only). It stops being on its way once verified and written:
	// if it stopped since the first look, the second finds it.
	f, off, n, err := s.store.OpenChunk(d, i)
	var live *liveChunk
	if errors.Is(err, content.ErrNotFound) && s.swarm != nil && r.Header.Get("Range") == "" {
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
	if up != nil {
		up.size.Store(n)
	}
	// An origin fetcher's upload is the swarm's narrowest pipe: every chunk
	// of its share must leave it once, as fast as the origin sends it. So
	// for resendAfter from a chunk's first send it sends it no more (the
	// first receiver passes it on), but for one repeat at a time while
	// half its upload slots are free: first copies keep most of the link,
	// and the rest is not left idle. Any other node sends a chunk to all
	// who ask, and spreads it sooner.
	// The refusal names the receiver, whom few may follow; a member who
	// found the receiver no source (it lied, or left) asks again, and gets
	// it, within bounds.
	ask := chunkAsk{once: s.originRole(d), again: r.Header.Get(sendAgainHeader) != "", from: peerOf(r), member: s.memberHost}
	if ok, to := s.sent.mark(d, i, ask); !ok {
		if s.slots == 0 || s.slotsHeld() > s.slots/2 || !s.repeating.CompareAndSwap(false, true) {
			if name := s.membersByHost()[to]; name != "" {
				w.Header().Set(sentToHeader, name)
			}
			w.Header().Set(busyHeader, "chunk")
			s.fail(w, "chunk", http.StatusServiceUnavailable, errors.New("chunk sent already; ask its receiver"))
			return
		}
		defer s.repeating.Store(false)
		s.sent.mark(d, i, chunkAsk{})
	}
	if live != nil {
		s.relay(w, r, up, live, d, i)
		return
	}
	code := http.StatusOK
	if h := r.Header.Get("Range"); h != "" {
		start, end, err := byterange.Parse(h, n)
		if err != nil {
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
	err = s.send(r.Context(), up, n, func(_, k int64) (int64, error) {
		// io.CopyN wraps f in an io.LimitedReader, which net/http hands to
		// sendfile on a plain connection: the bytes go from the page cache
		// to the socket.
		extendWrite(w)
		return io.CopyN(w, f, k)
	})
	if err != nil {
		s.uploadEnded(r, "chunk upload ended early", d, i, err)
	}
}

// uploadEnded logs an upload that ended early, and cuts off a peer that
// stopped reading it.
func (s *ChunkServer) uploadEnded(r *http.Request, msg string, d digest.Digest, i int, err error) {
	s.log.Debug(msg, "digest", d, "chunk", i, "peer", r.RemoteAddr, "err", err)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		s.cut(r)
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
func (s *ChunkServer) relay(w http.ResponseWriter, r *http.Request, up *upload, c *liveChunk, d digest.Digest, i int) {
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(relayHeader, "1")
	w.Header().Set("Trailer", hashHeader)
	w.WriteHeader(http.StatusOK)
	s.m.requests.WithLabelValues("relay", "200").Inc()
	err := s.send(r.Context(), up, int64(len(c.data())), func(off, k int64) (int64, error) {
		end, sum, err := c.wait(r.Context(), off)
		if err != nil {
			return 0, err
		}
		if sum != nil {
			w.Header().Set(hashHeader, hex.EncodeToString(sum))
		}
		extendWrite(w) // from when the bytes are here to send
		sent, err := w.Write(c.data()[off:min(end, off+k)])
		if f, ok := w.(http.Flusher); ok && err == nil {
			f.Flush()
		}
		return int64(sent), err
	})
	if err != nil {
		s.uploadEnded(r, "chunk relay ended early", d, i, err)
	}
}

// send sends n bytes of upload up (nil: no slot) with next, which sends
// up to k bytes from offset off, at most a sendPiece at a time, paced by
// the upload limit.
func (s *ChunkServer) send(ctx context.Context, up *upload, n int64, next func(off, k int64) (int64, error)) error {
	for off := int64(0); off < n; {
		sent, err := next(off, min(n-off, sendPiece))
		s.m.servedBytes.Add(float64(sent))
		s.sentBytes.Add(sent)
		if up != nil {
			up.sent.Add(sent)
		}
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

// sentToHeader names, on an origin fetcher's 503 for a chunk it sent once,
// the member it sent it to; sendAgainHeader, on a request, says that
// member proved no source to the asker.
const (
	sentToHeader    = "Weightd-Sent-To"
	sendAgainHeader = "Weightd-Send-Again"
)

// membersByHost maps each host a member's chunk server listens on to that
// member, or to "" where several share it (agents on one host, as in
// tests); nil without a swarm. Requests are told apart by host (peerOf).
func (s *ChunkServer) membersByHost() map[string]string {
	if s.swarm == nil || s.swarm.dir == nil {
		return nil
	}
	hosts := map[string]string{}
	for _, p := range s.swarm.dir.Members() {
		if host, _, err := net.SplitHostPort(p.Meta.ChunkAddr); err == nil {
			if _, shared := hosts[host]; shared {
				hosts[host] = ""
			} else {
				hosts[host] = p.Name
			}
		}
	}
	return hosts
}

// memberHost reports whether a member's chunk server listens on host.
func (s *ChunkServer) memberHost(host string) bool {
	_, ok := s.membersByHost()[host]
	return ok
}

// resendAfter is how long an origin fetcher waits before it sends a chunk
// again: long enough for the first receiver to have passed it on, short
// enough to recover soon from a receiver that died.
const resendAfter = 10 * time.Second

// maxSendsAgain bounds how often an origin fetcher sends a chunk again in
// its resendAfter: each send is a claim that the last receiver failed, and
// costs the cluster's narrowest upload a chunk.
const maxSendsAgain = 2

// maxSentBlobs bounds the blobs a sentLog remembers.
const maxSentBlobs = 256

func (s *ChunkServer) fail(w http.ResponseWriter, route string, code int, err error) {
	s.m.requests.WithLabelValues(route, strconv.Itoa(code)).Inc()
	http.Error(w, err.Error(), code)
}

func statusOf(err error) int {
	switch {
	case errors.Is(err, content.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, content.ErrInvalid):
		return http.StatusBadRequest
	default:
		return http.StatusInternalServerError
	}
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
