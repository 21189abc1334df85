package p2p

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/peertls"
)

// Directory is what the swarm needs to know of the cluster: who is alive,
// who holds what, and where their chunk servers are. *Membership and its
// Router together provide it (see NewDirectory).
type Directory interface {
	LocalName() string
	Members() []Peer
	Peer(name string) (Peer, bool)
	Holders(d digest.Digest) []Holder
}

// BoundedOpener is an origin that can read a bounded byte range, so that a
// chunk from the origin costs the origin exactly the chunk's bytes.
type BoundedOpener interface {
	OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error)
}

// SwarmConfig tunes the swarm downloader. The zero value of a field means
// its default.
type SwarmConfig struct {
	MaxInFlight    int           // chunk requests in flight per blob, all sources together (default 8, and at most 64 MiB of chunks)
	PerPeer        int           // requests in flight to one peer (default 2)
	OriginInFlight int           // requests in flight to the origin (default 2)
	OriginFetchers int           // nodes that fetch one blob from the origin, each a share of its chunks (default 2)
	Refresh        time.Duration // the least time between two reads of one holder's chunk state; each read waits at the holder for news (default 50ms)
	Settle         time.Duration // how long to let gossip settle before taking the origin role (default 1s)
	BanFor         time.Duration // how long a lying or failing peer is shunned (default 5m)
	OriginLinger   time.Duration // how long peers still see the origin role after a fill ends (default 1m)
	MinRate        int64         // the slowest acceptable transfer, bytes/s: request timeouts scale with it (default 256 KiB/s; a transfer that stalls for 5 s ends sooner)
	DownloadLimit  int64         // bytes/s for all chunk downloads together; 0 means no limit
	// TLS, when set, is this node's side of mutual TLS with its peers
	// (peertls.Identity.ClientConfig): chunk servers are asked over
	// https, and an answer counts only from a server whose certificate
	// names the member that advertises its address. nil speaks plain HTTP.
	TLS *tls.Config
}

func (c SwarmConfig) withDefaults() SwarmConfig {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.MaxInFlight, 8)
	def(&c.PerPeer, 2)
	def(&c.OriginInFlight, 2)
	def(&c.OriginFetchers, 2)
	if c.Refresh <= 0 {
		c.Refresh = 50 * time.Millisecond
	}
	if c.Settle <= 0 {
		c.Settle = time.Second
	}
	if c.BanFor <= 0 {
		c.BanFor = 5 * time.Minute
	}
	if c.OriginLinger <= 0 {
		c.OriginLinger = time.Minute
	}
	if c.MinRate <= 0 {
		c.MinRate = 256 << 10
	}
	return c
}

// Swarm downloads blobs from many peers at once and from the origin as one
// more source. Each blob is fetched chunk by chunk: rarest chunks first, a
// bounded number of requests per peer, each chunk verified against the chunk
// map before it is written, duplicates for the last chunks, timeouts scaled
// to the chunk size, bans for peers that lie or fail. Only the nodes chosen
// by rendezvous hashing of the digest (normally two) fetch from the origin;
// the others fetch from peers, which relay each chunk while it comes to them
// and serve it once verified, so a blob flows through the cluster as a
// pipeline.
type Swarm struct {
	dir      Directory
	client   *http.Client
	cfg      SwarmConfig
	download *rate.Limiter
	log      *slog.Logger
	m        *swarmMetrics

	requestsTo sync.Map // peer name → *atomic.Int32: this node's chunk requests in flight to it, over all fills

	mu     sync.Mutex
	bans   map[string]time.Time
	origin map[digest.Digest]int // blobs this node fetches from the origin for the cluster: holds of the role
	live   liveChunks            // chunks on their way here, which the chunk server relays
}

type swarmMetrics struct {
	received   *prometheus.CounterVec
	latency    *prometheus.HistogramVec
	bans       *prometheus.CounterVec
	mismatches prometheus.Counter
	originRole prometheus.Counter
}

// NewSwarm returns a swarm downloader over dir. client carries the chunk
// requests (nil for a default one, with cfg.TLS). Metrics are registered
// on reg (nil for none).
func NewSwarm(dir Directory, client *http.Client, cfg SwarmConfig, log *slog.Logger, reg prometheus.Registerer) (*Swarm, error) {
	if client == nil {
		// A peer's headers are a few lines; a hostile one's are not read
		// past 64 KiB (net/http's default reads up to 10 MiB). With TLS
		// it stays HTTP/1.1, a connection per request in flight, as in
		// plain HTTP: one HTTP/2 connection would queue chunks behind
		// each other in one TCP window.
		var rt http.RoundTripper = &http.Transport{MaxIdleConnsPerHost: 8, IdleConnTimeout: time.Minute,
			MaxResponseHeaderBytes: 64 << 10, TLSClientConfig: cfg.TLS, TLSHandshakeTimeout: 10 * time.Second}
		if cfg.TLS != nil {
			rt = peerIdentity{next: rt, dir: dir}
		}
		client = &http.Client{Transport: rt}
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg = cfg.withDefaults()
	s := &Swarm{dir: dir, client: client, cfg: cfg, download: newLimiter(cfg.DownloadLimit), log: log,
		bans: map[string]time.Time{}, origin: map[digest.Digest]int{}}
	s.m = &swarmMetrics{
		received: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_p2p_received_bytes_total", Help: "Verified chunk bytes received, by source (peer or origin).",
		}, []string{"source"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "weightd_p2p_chunk_fetch_seconds", Help: "Time to fetch and verify one chunk, by source.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}, []string{"source"}),
		bans: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_p2p_peer_bans_total", Help: "Peers banned for a while, by reason.",
		}, []string{"reason"}),
		mismatches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_p2p_chunkmap_mismatches_total", Help: "Chunks or chunk maps from peers that did not match.",
		}),
		originRole: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_p2p_origin_fetcher_total", Help: "Blobs this node fetched from the origin on behalf of the cluster.",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{s.m.received, s.m.latency, s.m.bans, s.m.mismatches, s.m.originRole} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("registering swarm metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Source returns a blob source for the cache that fills the blob from the
// swarm, with origin as the origin. It streams from origin alone if asked to
// stream. Its Want method says which byte a reader of the blob waits on:
// the chunks from there are fetched first (the registry mirror streams a
// blob to containerd in order).
func (s *Swarm) Source(desc cache.Descriptor, origin cache.RangeOpener) cache.RangeOpener {
	src := &swarmSource{s: s, desc: desc, origin: origin}
	src.want.Store(-1)
	return src
}

type swarmSource struct {
	s      *Swarm
	desc   cache.Descriptor
	origin cache.RangeOpener
	want   atomic.Int64 // the byte a reader waits on; -1 for none
}

// Want says that a reader waits on byte off of the blob.
func (src *swarmSource) Want(off int64) { src.want.Store(off) }

func (src *swarmSource) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	return src.origin.OpenRange(ctx, off)
}

// maxInFlightBytes bounds the chunk buffers one download holds, so memory
// stays flat whatever the chunk size.
const maxInFlightBytes = 64 << 20

// smallBlob is the largest blob fetched without the swarm's election when
// it fits in one chunk (configs, manifests, small layers): a copy per node
// costs the origin little, and an election costs seconds under load.
const smallBlob = 1 << 20

func (src *swarmSource) Fill(ctx context.Context, p *cache.Partial) error {
	if p.Chunks() == 1 && p.Descriptor().Size <= smallBlob {
		return src.s.fillSmall(ctx, p, src.origin)
	}
	f := &fill{s: src.s, p: p, origin: src.origin, d: p.Descriptor().Digest, start: time.Now(), want: &src.want,
		maxInFlight: max(2, min(src.s.cfg.MaxInFlight, int(maxInFlightBytes/p.ChunkSize()))), originHeard: time.Now(),
		peers: map[string]*peerView{}, absent: map[string]time.Time{},
		inflight: map[int]int{}, supplier: map[int]string{}, asked: map[int]string{},
		results: make(chan chunkResult, src.s.cfg.MaxInFlight*2), states: make(chan stateResult, 64),
		hashQueries: make(chan hashQuery, src.s.cfg.MaxInFlight*2)}
	return f.run(ctx)
}

// fillSmall fetches a blob of one small chunk without the swarm's
// election: from a peer that holds it whole, else from the origin. Its one
// chunk is the whole blob, so the blob's digest checks whoever sent it.
func (s *Swarm) fillSmall(ctx context.Context, p *cache.Partial, origin cache.RangeOpener) error {
	d := p.Descriptor().Digest
	want, err := hex.DecodeString(d.Encoded())
	if err != nil || d.Algorithm() != digest.SHA256 {
		return fmt.Errorf("%w: digest %s", cache.ErrInvalid, d)
	}
	n := p.ChunkLen(0)
	timeout := s.requestTimeout(n)
	for _, h := range s.dir.Holders(d) {
		if !h.Complete || h.Peer == s.dir.LocalName() || s.Banned(h.Peer) {
			continue
		}
		peer, ok := s.dir.Peer(h.Peer)
		if !ok || peer.Meta.ChunkAddr == "" {
			continue
		}
		c := newLiveChunk(n)
		_, err := s.fetchChunk(ctx, peer.Meta.ChunkAddr, d, 0, timeout, c)
		if err == nil {
			err = p.WritePeerChunk(0, c.data(), want)
		}
		c.release()
		if err == nil {
			s.m.received.WithLabelValues("peer").Add(float64(n))
			return nil
		}
		if errors.Is(err, cache.ErrDigestMismatch) {
			s.m.mismatches.Inc()
			s.ban(h.Peer, "corrupt_chunk")
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		s.log.Debug("small blob from a peer failed; trying the origin", "peer", h.Peer, "digest", d, "err", err)
		break // one holder tried: the origin answers as soon as the next would
	}
	c := newLiveChunk(n)
	defer c.release()
	if err := s.fetchOrigin(ctx, origin, 0, timeout, c); err != nil {
		return err
	}
	if err := p.WriteChunk(0, c.data(), want); err != nil {
		return fmt.Errorf("blob %s from the origin: %w", d, err)
	}
	s.m.received.WithLabelValues("origin").Add(float64(n))
	return nil
}

// FetchesFromOrigin reports whether this node is fetching d from the origin
// for the cluster; the chunk server tells peers (WithSwarm).
func (s *Swarm) FetchesFromOrigin(d digest.Digest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.origin[d] > 0
}

// setOrigin takes (on) or gives back one hold on the origin role for d.
// Holds are counted, so that a fill's lingering role, given back late,
// never clears the role a later fill of the same blob has taken.
func (s *Swarm) setOrigin(d digest.Digest, on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if on {
		s.origin[d]++
	} else if s.origin[d]--; s.origin[d] <= 0 {
		delete(s.origin, d)
	}
}

// Banned reports whether peer is shunned now.
func (s *Swarm) Banned(peer string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Now().Before(s.bans[peer])
}

func (s *Swarm) ban(peer, reason string) {
	s.mu.Lock()
	already := time.Now().Before(s.bans[peer])
	s.bans[peer] = time.Now().Add(s.cfg.BanFor)
	s.mu.Unlock()
	if already {
		return // several requests in flight failed the same way
	}
	s.m.bans.WithLabelValues(reason).Inc()
	s.log.Warn("banning peer", "peer", peer, "reason", reason, "for", s.cfg.BanFor)
}

// rendezvous orders names by their hash with d: every node computes the same
// order from the same set, and removing one name keeps the others' order.
func rendezvous(d digest.Digest, names []string) []string {
	type scored struct {
		name  string
		score uint64
	}
	all := make([]scored, len(names))
	for i, n := range names {
		h := fnv.New64a()
		h.Write([]byte(d))
		h.Write([]byte{0})
		h.Write([]byte(n))
		all[i] = scored{n, h.Sum64()}
	}
	slices.SortFunc(all, func(a, b scored) int { return cmp.Compare(b.score, a.score) })
	out := make([]string, len(all))
	for i, s := range all {
		out[i] = s.name
	}
	return out
}

// peerView is what one download knows of one holder.
type peerView struct {
	name      string
	addr      string
	state     PeerState
	known     bool      // state has been read at least once
	lastAlive time.Time // last time membership listed it alive
	reading   bool      // a state request is in flight
	readAt    time.Time
	inflight  int
	failures  int
	busyTill  time.Time
	chunkBusy map[int]time.Time // chunks it is sending to someone else now
	sentSeen  map[int]time.Time // when we first saw it had sent a chunk we miss
}

type chunkResult struct {
	chunk int
	peer  string // "" for the origin
	relay bool   // asked of a peer that was still receiving it
	err   error
	bytes int64
	took  time.Duration
}

type stateResult struct {
	peer  string
	state PeerState
	err   error
}

// fill is one blob's download through the swarm.
type fill struct {
	s      *Swarm
	p      *cache.Partial
	origin cache.RangeOpener
	d      digest.Digest
	start  time.Time

	want           *atomic.Int64 // the byte a reader waits on (-1 none): its chunks go first
	maxInFlight    int           // requests in flight, bounded by the chunk buffers they need
	peers          map[string]*peerView
	absent         map[string]time.Time // members that had none of the blob when asked, and when
	probedAt       time.Time            // when the first-ranked members were last looked for
	inflight       map[int]int          // chunk → requests in flight
	supplierMu     sync.Mutex
	supplier       map[int]string // chunk → the peer it came from ("" origin); written by request goroutines
	asked          map[int]string // chunk → the peer first asked for it (endgame duplicates go elsewhere)
	originRole     bool
	originSince    time.Time // when this node took the origin role
	originAtOnce   bool      // it took the role without waiting: alone, or among the first of all members
	originInflight int
	originFailures int       // origin requests failed in a row without an answer
	originHeard    time.Time // when the origin last sent bytes (or the download began)
	originPause    time.Time
	chunkTime      time.Duration // recent time to fetch one chunk (moving average)
	originTime     time.Duration // recent time to fetch one chunk from the origin (moving average)
	wg             sync.WaitGroup
	results        chan chunkResult
	states         chan stateResult
	hashQueries    chan hashQuery
	hashWaits      []hashQuery // queries not answered yet
}

func (f *fill) run(parent context.Context) error {
	// Requests run under ctx; the final check and repair under parent, after
	// the endgame duplicates have been cancelled.
	ctx, cancel := context.WithCancel(parent)
	defer func() {
		cancel()
		f.wg.Wait()
		f.release()
	}()
	tick := time.NewTicker(f.s.cfg.Refresh / 2)
	defer tick.Stop()
	for {
		missing := f.p.Missing()
		if len(missing) == 0 {
			cancel() // endgame duplicates still running
			f.wg.Wait()
			return f.verify(parent)
		}
		f.refresh(ctx)
		f.decideOrigin()
		f.answerHashes()
		if err := f.schedule(ctx, missing); err != nil {
			return err
		}
		select {
		case r := <-f.results:
			if err := f.handle(r); err != nil {
				return err
			}
		case st := <-f.states:
			f.updateState(st)
		case q := <-f.hashQueries:
			f.hashWaits = append(f.hashWaits, q)
		case <-tick.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// peerGrace is how long a holder that membership no longer lists is kept:
// under load, failure detection flaps, and a peer that answers is still
// worth asking (one that does not is soon banned).
const peerGrace = 10 * time.Second

// refresh learns new holders from gossip and re-reads chunk states; each
// read waits at the holder until it has news.
func (f *fill) refresh(ctx context.Context) {
	now := time.Now()
	for _, h := range f.s.dir.Holders(f.d) {
		f.addPeer(h.Peer, now)
	}
	members := f.s.dir.Members()
	alive := map[string]bool{}
	for _, m := range members {
		alive[m.Name] = true
	}
	// Gossip can miss a holder (it is UDP, and packets drop while links
	// are full), and the origin role hinges on the nodes ranked first for
	// the blob: ask those directly whether they hold it. Not more often
	// than a quarter of Settle: addPeer asks an absent member again no
	// sooner, and ranking the members costs a hash each.
	if now.Sub(f.probedAt) >= f.s.cfg.Settle/4 {
		f.probedAt = now
		names := f.withMembers(members)
		for _, name := range rendezvous(f.d, names)[:min(len(names), f.s.cfg.OriginFetchers+1)] {
			f.addPeer(name, now)
		}
	}
	for name, pv := range f.peers {
		if alive[name] {
			pv.lastAlive = now
		} else if now.Sub(pv.lastAlive) > peerGrace && pv.inflight == 0 && !pv.reading {
			delete(f.peers, name) // left the cluster
			continue
		}
		if pv.reading || f.s.Banned(name) || (pv.known && pv.state.Complete) || now.Sub(pv.readAt) < f.s.cfg.Refresh {
			continue
		}
		pv.reading, pv.readAt = true, now
		known := pv.state
		if !pv.known {
			known.Have = nil
		}
		f.wg.Add(1)
		go func(name, addr string) {
			defer f.wg.Done()
			st, err := f.s.readState(ctx, addr, f.d, f.p.Chunks(), pv.known, known)
			select {
			case f.states <- stateResult{peer: name, state: st, err: err}:
			case <-ctx.Done():
			}
		}(name, pv.addr)
	}
}

// absentFor is how long a member that had none of the blob when asked is
// not asked again (gossip says when it starts to hold it). While the origin
// role is being settled it is asked four times per Settle, so that nodes
// asked for the blob at about the same time all count each other.
const absentFor = 5 * time.Second

// addPeer starts to follow peer's state of the blob, unless it is this
// node, already followed, unknown or recently found absent.
func (f *fill) addPeer(name string, now time.Time) {
	again := absentFor
	if now.Sub(f.start) < 2*f.s.cfg.Settle {
		again = f.s.cfg.Settle / 4
	}
	if name == f.s.dir.LocalName() || f.peers[name] != nil || now.Sub(f.absent[name]) < again {
		return
	}
	peer, ok := f.s.dir.Peer(name)
	if !ok || peer.Meta.ChunkAddr == "" {
		return
	}
	f.peers[name] = &peerView{name: name, addr: peer.Meta.ChunkAddr, lastAlive: now,
		chunkBusy: map[int]time.Time{}, sentSeen: map[int]time.Time{}}
}

func (f *fill) updateState(r stateResult) {
	pv := f.peers[r.peer]
	if pv == nil {
		return
	}
	pv.reading = false
	if errors.Is(r.err, errNotHeld) && pv.inflight == 0 {
		delete(f.peers, r.peer)
		f.absent[r.peer] = time.Now()
		return
	}
	if errors.Is(r.err, errStateTooBig) {
		f.s.log.Warn("peer's chunk state is too big for the blob", "peer", r.peer, "digest", f.d, "err", r.err)
		f.s.ban(r.peer, "bad_state")
		return
	}
	if r.err != nil {
		f.s.log.Debug("reading peer chunk state", "peer", r.peer, "digest", f.d, "err", r.err)
		return
	}
	desc := f.p.Descriptor()
	if r.state.Size != desc.Size || r.state.ChunkSize != f.p.ChunkSize() {
		f.s.log.Warn("peer's chunk state does not fit the blob", "peer", r.peer, "digest", f.d,
			"size", r.state.Size, "chunkSize", r.state.ChunkSize)
		f.s.ban(r.peer, "bad_state")
		return
	}
	pv.state, pv.known = r.state, true
	now := time.Now()
	for i := range f.p.Chunks() {
		if _, seen := pv.sentSeen[i]; !seen && pv.state.WasSent(i) {
			pv.sentSeen[i] = now
		}
	}
}

// decideOrigin takes the origin role when this node ranks first among the
// nodes that want the blob (or the chosen one has not shown up after its
// turn), and no peer already fetches it from the origin or holds it whole.
// A node among the first of all live members takes it at once: no node can
// rank above it, so waiting for gossip to settle would only delay the swarm
// (by 1.25 s, 1.5% of a 512 MiB blob at 50 Mbit/s).
func (f *fill) decideOrigin() {
	fetchers, unknown, names := []string(nil), 0, []string{f.s.dir.LocalName()}
	for name, pv := range f.peers {
		if f.s.Banned(name) {
			continue
		}
		if !f.originRole && pv.known && pv.state.Complete {
			return // a peer can serve every chunk
		}
		switch {
		case !pv.known:
			unknown++
		case pv.state.Origin:
			fetchers = append(fetchers, name)
		}
		names = append(names, name)
	}
	order := rendezvous(f.d, names)
	if f.originRole {
		// Two nodes took the role (a slow gossip, a partition that healed):
		// the one ranked lower yields, so the origin serves one copy.
		if len(fetchers) >= f.s.cfg.OriginFetchers {
			mine := slices.Index(order, f.s.dir.LocalName())
			above := 0
			for _, p := range fetchers {
				if slices.Index(order, p) < mine {
					above++
				}
			}
			if above >= f.s.cfg.OriginFetchers {
				f.originRole = false
				f.s.setOrigin(f.d, false)
				f.s.log.Info("yielding the origin role", "digest", f.d, "to", fetchers)
			}
		}
		return
	}
	if len(fetchers) >= f.s.cfg.OriginFetchers {
		return
	}
	rank := slices.Index(order, f.s.dir.LocalName())
	members := f.s.dir.Members()
	alone := len(members) == 0 && len(f.peers) == 0
	turn := f.s.cfg.Settle * time.Duration(1+max(0, rank-(f.s.cfg.OriginFetchers-1)))
	// None can rank above a node among the first of all live members.
	first := slices.Index(rendezvous(f.d, f.withMembers(members)), f.s.dir.LocalName()) < f.s.cfg.OriginFetchers
	if first {
		turn = 0
	}
	// Until every holder's chunk state has been read, one of them may
	// already be the origin fetcher; wait for it, within reason.
	if unknown > 0 && time.Since(f.start) < turn+5*f.s.cfg.Settle {
		return
	}
	if alone || time.Since(f.start) >= turn {
		f.originRole, f.originSince, f.originAtOnce = true, time.Now(), alone || first
		f.s.m.originRole.Inc()
		f.s.setOrigin(f.d, true)
		f.s.log.Info("fetching from the origin for the cluster", "digest", f.d, "rank", rank, "candidates", len(names))
	}
}

// release ends the fill's hold on the origin role. Peers keep seeing the
// role until the blob is committed and its state says complete.
func (f *fill) release() {
	if f.originRole {
		time.AfterFunc(f.s.cfg.OriginLinger, func() { f.s.setOrigin(f.d, false) })
	}
}

// withMembers is this node's name followed by the names of members (the
// other live members).
func (f *fill) withMembers(members []Peer) []string {
	names := []string{f.s.dir.LocalName()}
	for _, m := range members {
		names = append(names, m.Name)
	}
	return names
}

// schedule starts requests until the limits are reached: as an origin
// fetcher, the first chunk of its share nobody has, from the origin; else
// the next chunk a reader waits on, or the rarest chunk, that a peer with a
// free slot has; else endgame duplicates.
func (f *fill) schedule(ctx context.Context, missing []int) error {
	total := f.inflightTotal()
	rand.Shuffle(len(missing), func(i, j int) { missing[i], missing[j] = missing[j], missing[i] })
	for total < f.maxInFlight {
		// The origin first: its fetchers are the swarm's only way in, and
		// every node waits on what they bring.
		if f.useOrigin() {
			if chunk := f.nextFromOrigin(missing); chunk >= 0 {
				f.launchOrigin(ctx, chunk)
				total++
				continue
			}
		}
		if !f.mayAskPeers(total, missing) {
			return nil
		}
		chunk, peer := f.pickWanted(missing, f.p.ChunkSize())
		if chunk < 0 {
			chunk, peer = f.pickFromPeers(missing, false)
		}
		if chunk < 0 {
			chunk, peer = f.pickFromPeers(missing, true)
		}
		if chunk < 0 {
			return nil
		}
		f.launchPeer(ctx, chunk, peer)
		total++
	}
	return nil
}

// fetcherPeerRequests bounds an origin fetcher's requests to peers while it
// still has chunks to fetch from the origin. Its downlink carries both, and
// TCP shares a link about evenly among its flows: with 6 peer requests
// beside 2 to the origin, the origin's flows got a quarter of it, one
// fetcher fell up to 15 s behind the other (8 × 50 Mbit/s, 512 MiB), and
// the origin, which the whole swarm waits on, sent the laggard's share at a
// fraction of its link. With 3 the fetchers finished their shares within
// 1–4 s of each other, and the swarm 2.5% sooner; 2 starved the fetchers'
// own downloads from peers, so that they finished last. Since peers relay
// chunks on their way, the other nodes finish sooner, and with 3 the
// fetchers came last, 2 s after them (8 × 100 Mbit/s): 4 gave 1.14 × S/B
// where 3 gave 1.16–1.18, and 5 1.15.
const fetcherPeerRequests = 4

// mayAskPeers reports whether another request may go to a peer, total
// being the requests in flight: not while this node is an origin fetcher
// with origin work left and fetcherPeerRequests already out to peers.
func (f *fill) mayAskPeers(total int, missing []int) bool {
	if !f.originRole || total-f.originInflight < fetcherPeerRequests {
		return true
	}
	return f.originInflight == 0 && f.nextFromOrigin(missing) < 0
}

// requestCounter is the count of this node's requests in flight to peer.
func (s *Swarm) requestCounter(peer string) *atomic.Int32 {
	if c, ok := s.requestsTo.Load(peer); ok {
		return c.(*atomic.Int32)
	}
	c, _ := s.requestsTo.LoadOrStore(peer, new(atomic.Int32))
	return c.(*atomic.Int32)
}

// inflightTo is how many chunk requests this node has in flight to peer,
// over all its fills: a holder serves one requester only so many chunks
// at once, whichever blobs they are of, and refuses more with a 503.
func (s *Swarm) inflightTo(peer string) int {
	if c, ok := s.requestsTo.Load(peer); ok {
		return int(c.(*atomic.Int32).Load())
	}
	return 0
}

// inflightTotal is the requests in flight, to peers and the origin.
func (f *fill) inflightTotal() int {
	total := f.originInflight
	for _, pv := range f.peers {
		total += pv.inflight
	}
	return total
}

// pickFromPeers returns the rarest missing chunk not in flight (or, for
// endgame, in flight once) that a usable peer has or is receiving, and the
// best such peer (supplyRank, then the least loaded); -1 if none.
func (f *fill) pickFromPeers(missing []int, endgame bool) (int, *peerView) {
	if endgame {
		for _, i := range missing {
			if f.inflight[i] == 0 {
				return -1, nil // not the endgame yet: some chunk is not even asked for
			}
		}
		if len(missing) > f.maxInFlight {
			return -1, nil
		}
	}
	// Score: rarer is better, and a chunk its holder has not yet sent to
	// anyone beats one it has (the others can get that one from whoever
	// received it), so a holder's upload goes to distinct chunks.
	best, bestScore := -1, 0
	var bestPeer *peerView
	now := time.Now()
	for _, i := range missing {
		if (!endgame && f.inflight[i] != 0) || (endgame && f.inflight[i] != 1) {
			continue
		}
		pick, count := f.supplierOf(i, endgame, now)
		if pick == nil {
			continue
		}
		// The only holder already sent this chunk to someone, who will
		// pass it on soon: wait a little for that copy rather than spend
		// the holder's upload on it twice.
		if count == 1 && !endgame && pick.state.WasSent(i) && now.Sub(pick.sentSeen[i]) < f.holdoff() {
			continue
		}
		score := 2 * count
		if pick.state.WasSent(i) {
			score++
		}
		if best < 0 || score < bestScore {
			best, bestScore, bestPeer = i, score, pick
		}
	}
	return best, bestPeer
}

// supplierOf returns the best usable peer to ask for chunk i (supplyRank,
// then the least loaded; nil if none is free) and how many known peers
// have or are receiving it.
func (f *fill) supplierOf(i int, endgame bool, now time.Time) (pick *peerView, count int) {
	var fetcher *peerView
	for _, pv := range f.peers {
		if !pv.known || (!pv.state.Has(i) && !pv.state.IsFetching(i)) {
			continue
		}
		count++
		if f.s.inflightTo(pv.name) >= f.s.cfg.PerPeer || now.Before(pv.busyTill) || now.Before(pv.chunkBusy[i]) ||
			f.s.Banned(pv.name) || (endgame && f.asked[i] == pv.name) {
			continue
		}
		// An origin fetcher's upload is the swarm's narrowest pipe:
		// every chunk of its share must leave it once, as fast as it
		// comes from the origin. It is asked again for a chunk it
		// already sent (but for the last chunks) only when no other
		// holder is free; it sends one such repeat at a time, when its
		// upload has room, and refuses the others.
		if pv.state.Origin && !endgame && pv.state.WasSent(i) {
			fetcher = pv
			continue
		}
		if pick == nil || supplyRank(pv, i) < supplyRank(pick, i) ||
			(supplyRank(pv, i) == supplyRank(pick, i) && f.s.inflightTo(pv.name) < f.s.inflightTo(pick.name)) {
			pick = pv
		}
	}
	if pick == nil {
		pick = fetcher
	}
	return pick, count
}

// pickWanted returns the lowest missing chunk from the byte a reader waits
// on (Want), within maxInFlight chunks of it, that is asked of no one and
// that a free peer can supply; -1 if none. A reader's next bytes beat
// rarity: the registry mirror streams a blob to containerd in order, and
// a pull's progress is its prefix.
func (f *fill) pickWanted(missing []int, chunkSize int64) (int, *peerView) {
	if f.want == nil || f.want.Load() < 0 {
		return -1, nil
	}
	first := int(f.want.Load() / chunkSize)
	best := -1
	var bestPeer *peerView
	now := time.Now()
	for _, i := range missing {
		if i < first || i >= first+f.maxInFlight || (best >= 0 && i > best) || f.inflight[i] != 0 {
			continue
		}
		if pick, _ := f.supplierOf(i, false, now); pick != nil {
			best, bestPeer = i, pick
		}
	}
	return best, bestPeer
}

// supplyRank orders the peers that can supply chunk i, best first: one
// that holds it and has not sent it to anyone (its upload goes to distinct
// chunks), one receiving it (it relays the chunk as it comes), one that
// holds it and sent it already (whoever got it passes it on).
func supplyRank(pv *peerView, i int) int {
	switch {
	case !pv.state.Has(i):
		return 1
	case pv.state.WasSent(i):
		return 2
	default:
		return 0
	}
}

// useOrigin reports whether a request to the origin may start now. A node
// that has just taken the role waits a quarter of Settle first, for word of
// any node ranked above it that took the role at the same moment (it then
// yields before the origin sends it a byte), unless none can rank above it.
func (f *fill) useOrigin() bool {
	now := time.Now()
	return f.originRole && f.originInflight < min(f.s.cfg.OriginInFlight, f.maxInFlight) &&
		now.After(f.originPause) && (f.originAtOnce || now.Sub(f.originSince) >= f.s.cfg.Settle/4)
}

// nextFromOrigin is the chunk this node fetches next from the origin, or
// -1: the lowest missing chunk of its origin share that it has not in
// flight and no known peer has or is receiving, so the origin
// fetchers extend the swarm's prefix in order. With its own share done, it
// helps the others: the highest such chunk of another share. A fetcher
// whose downlink carries more flows falls behind (their shares ended up to
// 10 s apart at 8 × 50 Mbit/s), and the origin's link, which every node
// waits on, would send the rest of its share at a fraction of its rate.
// The owner works from the front of its share and the helper from the
// back, each skipping what the other says it fetches, so they meet without
// fetching a chunk twice.
func (f *fill) nextFromOrigin(missing []int) int {
	share, fetchers := f.originShare()
	// It helps only fetchers it follows: it sees what they have and fetch.
	followed := make([]bool, len(fetchers))
	for j, name := range fetchers {
		pv := f.peers[name]
		followed[j] = pv != nil && pv.known && pv.state.Origin
	}
	untaken := make([][]int, len(fetchers)) // each share's chunks no node has or fetches
	for _, i := range missing {
		j := i % len(fetchers)
		if f.inflight[i] != 0 || (j != share && !followed[j]) {
			continue
		}
		taken := false
		for _, pv := range f.peers {
			if pv.known && (pv.state.Has(i) || pv.state.IsFetching(i)) && !f.s.Banned(pv.name) {
				taken = true
				break
			}
		}
		if !taken {
			untaken[j] = append(untaken[j], i)
		}
	}
	if len(untaken[share]) > 0 {
		return slices.Min(untaken[share])
	}
	// Help the fetcher with the most left, but leave it what it may ask
	// for before word of it reaches here, and word of this node's request
	// reaches it: its requests in flight, again for each origin chunk time
	// in stateLag. Where the origin sends a chunk much sooner than that,
	// helping would fetch chunks twice, and a lagging share costs little.
	if f.originTime <= 0 {
		return -1
	}
	leave := f.s.cfg.OriginInFlight * (1 + int(f.stateLag()/f.originTime))
	behind := -1
	for j, left := range untaken {
		if j != share && len(left) > leave && (behind < 0 || len(left) > len(untaken[behind])) {
			behind = j
		}
	}
	if behind < 0 {
		return -1
	}
	return slices.Max(untaken[behind])
}

// stateLag bounds how long word of a request takes from one origin
// fetcher to another and back: each reads the other's state at most once
// per Refresh, and a server looks for news every statePoll.
func (f *fill) stateLag() time.Duration {
	return 2 * (f.s.cfg.Refresh + statePoll)
}

// originShare is this node's share of the origin fetch: the chunks i with
// i%len(fetchers) == share, where fetchers are the origin fetchers this
// node knows of, itself included, in rendezvous order (share j is
// fetchers[j]'s), and share is its place among them. Each chunk then
// leaves the origin once, and each fetcher's upload, which must pass on
// every chunk it fetches, carries only its share: one fetcher alone would
// have to upload as fast as the origin sends, and the swarm would lag it
// by whatever it lost.
func (f *fill) originShare() (share int, fetchers []string) {
	local := f.s.dir.LocalName()
	fetching, candidates := []string{local}, []string{local}
	for name, pv := range f.peers {
		if f.s.Banned(name) {
			continue
		}
		candidates = append(candidates, name)
		if pv.known && pv.state.Origin {
			fetching = append(fetching, name)
		}
	}
	// Right after taking the role, the nodes that took it at the same
	// moment (the first in rendezvous order) may not have said so yet.
	if time.Since(f.originSince) < f.s.cfg.Settle {
		if f.originAtOnce {
			// It did not wait to learn who wants the blob: the other
			// first members may, and not be followed yet.
			candidates = slices.DeleteFunc(f.withMembers(f.s.dir.Members()), f.s.Banned)
		}
		for _, name := range rendezvous(f.d, candidates)[:min(len(candidates), f.s.cfg.OriginFetchers)] {
			if !slices.Contains(fetching, name) {
				fetching = append(fetching, name)
			}
		}
	}
	order := rendezvous(f.d, fetching)
	return slices.Index(order, local), order
}

// launchPeer asks pv for chunk i. A peer that is still receiving the
// chunk relays it as it comes, and gives its hash after the last byte:
// which hash the chunk must have is settled then (askHash).
func (f *fill) launchPeer(ctx context.Context, i int, pv *peerView) {
	f.inflight[i]++
	pv.inflight++
	if f.inflight[i] == 1 {
		f.asked[i] = pv.name
	}
	relay := !pv.state.Has(i)
	var want []byte
	if !relay {
		want = f.trustedHash(i, pv.name, pv.state.Hash(i))
	}
	n := f.p.ChunkLen(i)
	timeout := f.timeout(i)
	toPeer := f.s.requestCounter(pv.name)
	toPeer.Add(1)
	f.wg.Add(1)
	go func(name, addr string) {
		defer f.wg.Done()
		start := time.Now()
		c := f.s.live.chunk(f.d, i, n)
		claim, err := f.s.fetchChunk(ctx, addr, f.d, i, timeout, c)
		if err == nil && want == nil {
			want, err = f.askHash(ctx, i, name, claim)
		}
		if err == nil {
			err = f.write(i, c.data(), want, name)
		}
		f.settle(i, c, err)
		toPeer.Add(-1)
		f.report(ctx, chunkResult{chunk: i, peer: name, relay: relay, err: err, bytes: n, took: time.Since(start)})
	}(pv.name, pv.addr)
}

// trustedHash is the hash chunk i from peer from must have: the one an
// origin fetcher other than from advertises if any does (it hashed the
// origin's bytes), else own, from's. A peer that disagrees with an origin
// fetcher is lying.
func (f *fill) trustedHash(i int, from string, own []byte) []byte {
	if h := f.fetcherHash(i, from); h != nil {
		if own != nil && !bytes.Equal(h, own) {
			f.s.m.mismatches.Inc()
		}
		return h
	}
	return own
}

// fetcherHash is the hash of chunk i that an origin fetcher other than
// from advertises, or nil.
func (f *fill) fetcherHash(i int, from string) []byte {
	for _, pv := range f.peers {
		if pv.state.Origin && pv.known && pv.name != from {
			if h := pv.state.Hash(i); h != nil {
				return h
			}
		}
	}
	return nil
}

// followsFetcher reports whether this download follows an origin fetcher
// other than from.
func (f *fill) followsFetcher(from string) bool {
	for _, pv := range f.peers {
		if pv.state.Origin && pv.known && pv.name != from && !f.s.Banned(pv.name) {
			return true
		}
	}
	return false
}

// hashQuery asks the download's loop which hash chunk i, relayed by peer
// from, must have; claim is from's own word, sent after the bytes.
type hashQuery struct {
	chunk int
	from  string
	claim []byte
	since time.Time
	reply chan []byte // nil: no hash can be trusted
}

// hashWait bounds how long a relayed chunk waits for word of its hash
// from an origin fetcher before it takes the relay's: the fetcher
// verified the chunk before the relay could, and its state says so within
// milliseconds, unless the fetcher is gone.
const hashWait = time.Second

var errNoHash = errors.New("no hash to check the chunk against")

// askHash waits for the loop's answer to a hashQuery.
func (f *fill) askHash(ctx context.Context, i int, from string, claim []byte) ([]byte, error) {
	q := hashQuery{chunk: i, from: from, claim: claim, since: time.Now(), reply: make(chan []byte, 1)}
	select {
	case f.hashQueries <- q:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case h := <-q.reply:
		if h == nil {
			return nil, errNoHash
		}
		return h, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// answerHashes answers the hash queries it can: with another origin
// fetcher's hash, else the relay's own word. Less than hashWait after the
// query it waits instead while the relay's word is still to come in its
// state (it had verified the chunk when asked, and sent it whole, without
// a trailer), or while the relay is not an origin fetcher itself and an
// origin fetcher is followed: that one's word is due. (With none, the blob
// is one a peer holds whole, or its fetchers are done or gone.)
func (f *fill) answerHashes() {
	now := time.Now()
	waiting := f.hashWaits[:0]
	for _, q := range f.hashWaits {
		pv := f.peers[q.from]
		claim := q.claim
		if claim == nil && pv != nil {
			claim = pv.state.Hash(q.chunk)
		}
		fromFetcher := pv != nil && pv.state.Origin
		h := f.fetcherHash(q.chunk, q.from)
		if h == nil && now.Sub(q.since) < hashWait && (claim == nil || (!fromFetcher && f.followsFetcher(q.from))) {
			waiting = append(waiting, q)
			continue
		}
		q.reply <- f.trustedHash(q.chunk, q.from, claim)
	}
	clear(f.hashWaits[len(waiting):])
	f.hashWaits = waiting
}

func (f *fill) launchOrigin(ctx context.Context, i int) {
	f.inflight[i]++
	f.originInflight++
	n := f.p.ChunkLen(i)
	off := int64(i) * f.p.ChunkSize()
	timeout := f.timeout(i)
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		start := time.Now()
		c := f.s.live.chunk(f.d, i, n)
		err := f.s.fetchOrigin(ctx, f.origin, off, timeout, c)
		if err == nil {
			err = f.write(i, c.data(), nil, "")
		}
		f.settle(i, c, err)
		f.report(ctx, chunkResult{chunk: i, err: err, bytes: n, took: time.Since(start)})
	}()
}

// settle ends the transfer of chunk i into c: its relays complete if it
// was written, and end short if not.
func (f *fill) settle(i int, c *liveChunk, err error) {
	var sum []byte
	if err == nil {
		sum = f.p.Hash(i)
	}
	c.settle(sum)
}

// write stores chunk i and records who supplied it (the first to, when
// endgame duplicates race), for the repair after a failed final check.
func (f *fill) write(i int, data, want []byte, supplier string) error {
	write := f.p.WriteChunk
	if supplier != "" {
		write = f.p.WritePeerChunk
	}
	if err := write(i, data, want); err != nil {
		return err
	}
	f.supplierMu.Lock()
	_, dup := f.supplier[i]
	if !dup {
		f.supplier[i] = supplier
	}
	f.supplierMu.Unlock()
	if !dup {
		f.s.m.received.WithLabelValues(sourceOf(supplier)).Add(float64(len(data)))
	}
	return nil
}

func (f *fill) report(ctx context.Context, r chunkResult) {
	select {
	case f.results <- r:
	case <-ctx.Done():
	}
}

// handle books a finished request: credit or penalise its source.
func (f *fill) handle(r chunkResult) error {
	f.inflight[r.chunk]--
	source := sourceOf(r.peer)
	if r.peer == "" {
		f.originInflight--
	} else if pv := f.peers[r.peer]; pv != nil {
		pv.inflight--
	}
	if r.err == nil {
		f.s.m.latency.WithLabelValues(source).Observe(r.took.Seconds())
		f.chunkTime = (3*f.chunkTime + r.took) / 4
		f.s.log.Debug("chunk fetched", "digest", f.d, "chunk", r.chunk, "from", cmp.Or(r.peer, "origin"), "took", r.took, "inflight", f.inflightTotal())
		if pv := f.peers[r.peer]; pv != nil {
			pv.failures = 0
		}
		if r.peer == "" {
			f.originFailures, f.originHeard = 0, time.Now()
			f.originTime = (3*f.originTime + r.took) / 4
		}
		return nil
	}
	if errors.Is(r.err, context.Canceled) {
		return nil
	}
	if errors.Is(r.err, cache.ErrDiskFull) {
		return r.err
	}
	if r.peer == "" {
		return f.originFailed(r)
	}
	pv := f.peers[r.peer]
	switch {
	case errors.Is(r.err, errChunkBusy):
		if pv != nil {
			pv.chunkBusy[r.chunk] = time.Now().Add(f.s.cfg.Refresh)
		}
	case errors.Is(r.err, errBusy):
		if pv != nil {
			pv.busyTill = time.Now().Add(f.s.cfg.Refresh)
		}
	case errors.Is(r.err, errSlow):
		// Its upload is shared by many requesters: ask it less for a
		// while, but a popular peer (the origin fetcher above all) is
		// not banned for being popular.
		f.s.log.Debug("peer too slow for a chunk", "peer", r.peer, "digest", f.d, "chunk", r.chunk, "err", r.err)
		if pv != nil {
			pv.busyTill = time.Now().Add(slowBackoff)
		}
	case errors.Is(r.err, cache.ErrDigestMismatch):
		f.s.m.mismatches.Inc()
		f.s.ban(r.peer, "corrupt_chunk")
	case errors.Is(r.err, errRelayCut) || errors.Is(r.err, errNoHash) || (r.relay && errors.Is(r.err, errNotHeld)):
		// The chunk failed on its way to the relay (or before it was
		// asked), or came whole and its hash did not: not the relay's
		// fault. Ask again after the next word of its state.
		f.s.log.Debug("relayed chunk failed", "peer", r.peer, "digest", f.d, "chunk", r.chunk, "err", r.err)
		if pv != nil {
			pv.chunkBusy[r.chunk] = time.Now().Add(f.s.cfg.Refresh)
			pv.readAt = time.Time{}
		}
	default:
		f.s.log.Debug("peer chunk failed", "peer", r.peer, "digest", f.d, "chunk", r.chunk, "err", r.err)
		if pv != nil {
			pv.failures++
			pv.busyTill = time.Now().Add(2 * f.s.cfg.Refresh)
			pv.readAt = time.Time{} // re-read its state before asking again
			if pv.failures >= 3 {
				f.s.ban(r.peer, "failing")
			}
		}
	}
	return nil
}

// Origin failures the download tolerates: it gives up only after
// originGiveUp failures in a row and originPatience without a byte from
// the origin. The origin is not a peer: there is no other to turn to, and
// a registry whose link is shared by many pulls is slow, not gone.
const (
	originGiveUp   = 5
	originPatience = 30 * time.Second
	originMaxPause = 5 * time.Second
)

// originFailed books a failed origin request. A slow answer (some bytes,
// then the deadline) is not a failure: the origin answers, its link is
// busy. Other failures back off, doubling up to originMaxPause.
func (f *fill) originFailed(r chunkResult) error {
	if errors.Is(r.err, cache.ErrPermanent) {
		return fmt.Errorf("origin: %w", r.err)
	}
	now := time.Now()
	if errors.Is(r.err, errSlow) {
		f.originHeard = now
		f.s.log.Debug("origin chunk too slow; asking again", "digest", f.d, "chunk", r.chunk, "err", r.err)
		return nil
	}
	f.originFailures++
	if f.originFailures >= originGiveUp && now.Sub(f.originHeard) >= originPatience {
		return fmt.Errorf("origin failed %d times in a row, and sent nothing for %s: %w",
			f.originFailures, now.Sub(f.originHeard).Round(time.Second), r.err)
	}
	f.originPause = now.Add(min(originMaxPause, 200*time.Millisecond<<min(f.originFailures-1, 5)))
	f.s.log.Warn("origin chunk failed; retrying", "digest", f.d, "chunk", r.chunk, "failures", f.originFailures, "err", r.err)
	return nil
}

// verify checks the whole blob; if a wrong chunk map let bad chunks in, it
// refetches the chunks that came from peers from the origin, bans the peers
// whose chunks differ, and checks again.
func (f *fill) verify(ctx context.Context) error {
	err := f.p.Verify()
	if !errors.Is(err, cache.ErrDigestMismatch) {
		return err
	}
	f.s.log.Warn("blob from the swarm failed verification; repairing from the origin", "digest", f.d)
	blamed := map[string]bool{}
	for i := range f.p.Chunks() {
		peer, fromPeer := f.supplier[i]
		if !fromPeer || peer == "" {
			continue
		}
		err := f.repair(ctx, i, func() {
			if !blamed[peer] {
				blamed[peer] = true
				f.s.m.mismatches.Inc()
				f.s.ban(peer, "wrong_chunk_map")
			}
		})
		if err != nil {
			return fmt.Errorf("repairing chunk %d of %s from the origin: %w", i, f.d, err)
		}
		f.supplier[i] = ""
	}
	return f.p.Verify()
}

// repair fetches chunk i from the origin and, if it differs from what is
// stored, calls blame and replaces it.
func (f *fill) repair(ctx context.Context, i int, blame func()) error {
	c := newLiveChunk(f.p.ChunkLen(i))
	defer c.release()
	if err := f.s.fetchOrigin(ctx, f.origin, int64(i)*f.p.ChunkSize(), 5*time.Minute, c); err != nil {
		return err
	}
	sum := sha256.Sum256(c.data())
	if bytes.Equal(sum[:], f.p.Hash(i)) {
		return nil
	}
	blame()
	f.p.Invalidate(i)
	return f.p.WriteChunk(i, c.data(), nil)
}

// sourceOf is the metric label of a chunk's supplier.
func sourceOf(supplier string) string {
	if supplier == "" {
		return "origin"
	}
	return "peer"
}

var (
	errRelayCut  = errors.New("relayed chunk cut short: it failed at the relay")
	errBusy      = errors.New("peer busy")
	errChunkBusy = errors.New("peer sent this chunk already")
	errSlow      = errors.New("peer too slow")
	errNotHeld   = errors.New("404 Not Found") // the peer holds none of it
)

// slowBackoff is how long a peer that sent a chunk too slowly is not asked
// for another.
const slowBackoff = 2 * time.Second

// timeout bounds one request for chunk i.
func (f *fill) timeout(i int) time.Duration { return f.s.requestTimeout(f.p.ChunkLen(i)) }

// requestTimeout bounds one request for n bytes: n at the slowest
// acceptable rate, and a few seconds to start.
func (s *Swarm) requestTimeout(n int64) time.Duration {
	return 5*time.Second + time.Duration(n*int64(time.Second)/s.cfg.MinRate)
}

// holdoff is how long to wait for a chunk to come from the peer its only
// holder sent it to: about one chunk's transfer time.
func (f *fill) holdoff() time.Duration {
	if f.chunkTime == 0 {
		return 500 * time.Millisecond
	}
	return min(f.chunkTime*3/2, 5*time.Second)
}

// stateWait is how long a state request may wait for news at the peer.
const stateWait = time.Second

// errStateTooBig is a peer's chunk state longer than any state of the
// blob: it is not read further, and the peer is banned.
var errStateTooBig = errors.New("chunk state too big for the blob")

// readState asks a peer's chunk server for its state of d, a blob of
// chunks chunks. Once a state is known, the server answers when it differs
// (more chunks, or the origin role taken or given up) or after stateWait,
// so a chunk is known to its requesters within milliseconds of being
// verified. An answer longer than a state of the blob can be is refused
// before it is read past that (errStateTooBig): a peer could otherwise make
// it read and decode up to maxChunkStateBytes, 520 MiB, at every news.
func (s *Swarm) readState(ctx context.Context, addr string, d digest.Digest, chunks int, known bool, last PeerState) (PeerState, error) {
	ctx, cancel := context.WithTimeout(ctx, stateWait+5*time.Second)
	defer cancel()
	url := s.peerURL(addr, fmt.Sprintf(statePath, d))
	if known {
		url += fmt.Sprintf("?since=%d&wait=%s", countBits(last.Have), stateWait)
		// So do the chunks on their way to it: it relays them as they
		// come (pickFromPeers), and the origin fetchers do not fetch them
		// (nextFromOrigin).
		url += fmt.Sprintf("&fetching=%d", countBits(last.Fetching))
		if last.Origin {
			// An origin fetcher's first sends matter too: it is not
			// asked again for what it sent (pickFromPeers).
			url += fmt.Sprintf("&origin=1&sent=%d", countBits(last.Sent))
		} else {
			url += "&origin=0"
		}
		if len(last.Have) <= maxKnownParam {
			url += "&known=" + base64.RawURLEncoding.EncodeToString(last.Have)
		}
	}
	limit := maxPeerStateBytes(chunks)
	b, err := s.getSmall(ctx, url, limit)
	if errors.Is(err, errAnswerTooBig) {
		return PeerState{}, fmt.Errorf("chunk state from %s: %w of %d chunks, at most %d bytes: %w", addr, errStateTooBig, chunks, limit, err)
	}
	if err != nil {
		return PeerState{}, fmt.Errorf("chunk state from %s: %w", addr, err)
	}
	st, err := DecodePeerState(b)
	if err == nil {
		err = st.fillKnown(last)
	}
	return st, err
}

// maxKnownParam bounds the bitmap of known hashes a state request sends
// (16 Ki chunks, 32 GiB of 2 MiB chunks); a larger blob's states carry
// all their hashes.
const maxKnownParam = 2 << 10

// errAnswerTooBig is a peer's answer longer than its limit.
var errAnswerTooBig = errors.New("answer too big")

// getSmall GETs a small answer from a peer: 200 and at most limit bytes.
// An answer that says it is longer is not read at all, and one that does
// not say is read only to limit+1 bytes (errAnswerTooBig).
func (s *Swarm) getSmall(ctx context.Context, url string, limit int64) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		drain(resp.Body)
		if resp.StatusCode == http.StatusNotFound {
			return nil, errNotHeld
		}
		return nil, errors.New(resp.Status)
	}
	if resp.ContentLength > limit {
		return nil, fmt.Errorf("%w: %d bytes said, over %d", errAnswerTooBig, resp.ContentLength, limit)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err == nil && int64(len(b)) > limit {
		err = fmt.Errorf("%w: over %d bytes", errAnswerTooBig, limit)
	}
	return b, err
}

// peerURL is the URL of path on the chunk server at addr.
func (s *Swarm) peerURL(addr, path string) string {
	if s.cfg.TLS != nil {
		return "https://" + addr + path
	}
	return "http://" + addr + path
}

// errNotThePeer is an answer from a chunk server whose certificate names
// another node than the member that advertises its address.
var errNotThePeer = errors.New("chunk server is not the member it is advertised by")

// peerIdentity is a swarm's transport under mutual TLS. Peers are asked by
// the chunk address they gossip, so the handshake can verify only that the
// server holds a certificate of the cluster's CA; peerIdentity then
// refuses its answer unless the node name in it is that of the one member
// advertising the address. A member cannot pass itself off as another, nor
// serve under a second, self-chosen member name (for the rendezvous of
// shared resolutions, say), from its own chunk server.
type peerIdentity struct {
	next http.RoundTripper
	dir  Directory
}

func (p peerIdentity) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := p.next.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	name := peertls.PeerName(resp.TLS)
	var claims []string
	for _, m := range p.dir.Members() {
		if m.Meta.ChunkAddr == req.URL.Host {
			claims = append(claims, m.Name)
		}
	}
	if len(claims) != 1 || claims[0] != name {
		resp.Body.Close()
		return nil, fmt.Errorf("%w: %s is node %q, advertised by %q", errNotThePeer, req.URL.Host, name, claims)
	}
	return resp, nil
}

// drain reads the rest of a short error answer, best effort, so that its
// connection goes back to the pool: closing a body before its end closes
// the connection, and a busy peer answers often.
func drain(body io.Reader) {
	_, _ = io.Copy(io.Discard, io.LimitReader(body, 4<<10))
}

// fetchChunk downloads chunk i of d from a peer into c, within timeout,
// and returns the peer's hash of it, its claim: in a header, or in a
// trailer for a relayed chunk (one the peer was still receiving); nil from
// an agent that sends none.
func (s *Swarm) fetchChunk(ctx context.Context, addr string, d digest.Digest, i int, timeout time.Duration, c *liveChunk) (claim []byte, err error) {
	ctx, watch := watchTransfer(ctx, timeout)
	defer watch.stop()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.peerURL(addr, fmt.Sprintf(chunkPath, d, i)), nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		drain(resp.Body)
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusServiceUnavailable, http.StatusTooManyRequests:
		if resp.Header.Get(busyHeader) == "chunk" {
			return nil, errChunkBusy
		}
		return nil, errBusy
	case http.StatusNotFound:
		return nil, errNotHeld
	default:
		return nil, fmt.Errorf("chunk %d from %s: %s", i, addr, resp.Status)
	}
	n := int64(len(c.data()))
	relayed := resp.Header.Get(relayHeader) != ""
	if !relayed && resp.ContentLength != n {
		return nil, fmt.Errorf("chunk %d from %s: %d bytes, want %d", i, addr, resp.ContentLength, n)
	}
	c.share()
	if err := s.readInto(ctx, watch, resp.Body, c); err != nil {
		if relayed && (errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF)) {
			err = fmt.Errorf("%w: %w", errRelayCut, err)
		}
		return nil, err
	}
	hash := resp.Header.Get(hashHeader)
	if relayed {
		// The hash comes in the trailer, after the body's end.
		if k, err := resp.Body.Read(make([]byte, 1)); k != 0 || !errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("chunk %d from %s: over %d bytes, or cut: %v", i, addr, n, err)
		}
		hash = resp.Trailer.Get(hashHeader)
	} else if hash == "" {
		return nil, nil // an agent that predates the header
	}
	claim, err = hex.DecodeString(hash)
	if err != nil || len(claim) != sha256.Size {
		return nil, fmt.Errorf("chunk %d from %s: hash %q", i, addr, hash)
	}
	return claim, nil
}

// fetchOrigin downloads [off, off+len(c)) from the origin into c.
func (s *Swarm) fetchOrigin(ctx context.Context, origin cache.RangeOpener, off int64, timeout time.Duration, c *liveChunk) error {
	ctx, watch := watchTransfer(ctx, timeout)
	defer watch.stop()
	var body io.ReadCloser
	var err error
	if b, ok := origin.(BoundedOpener); ok {
		body, err = b.OpenBoundedRange(ctx, off, int64(len(c.data())))
	} else {
		body, err = origin.OpenRange(ctx, off)
	}
	if err != nil {
		return err
	}
	defer body.Close()
	c.share()
	return s.readInto(ctx, watch, body, c)
}

// stallTimeout is how long a transfer may go without a byte: a peer whose
// upload is shared by many still sends every few hundred milliseconds.
const stallTimeout = 5 * time.Second

var errStalled = errors.New("no bytes for " + stallTimeout.String())

// transferWatch ends a transfer at its deadline, or sooner when it stalls.
type transferWatch struct {
	timer        *time.Timer
	cancel       context.CancelCauseFunc
	stopDeadline context.CancelFunc
}

// watchTransfer returns a context for one transfer that ends after timeout
// or once no bytes have come for stallTimeout (see progress).
func watchTransfer(ctx context.Context, timeout time.Duration) (context.Context, *transferWatch) {
	ctx, stopDeadline := context.WithTimeout(ctx, timeout)
	ctx, cancel := context.WithCancelCause(ctx)
	w := &transferWatch{cancel: cancel, stopDeadline: stopDeadline}
	w.timer = time.AfterFunc(stallTimeout, func() { cancel(errStalled) })
	return ctx, w
}

// progress restarts the stall clock.
func (w *transferWatch) progress() { w.timer.Reset(stallTimeout) }

func (w *transferWatch) stop() {
	w.timer.Stop()
	w.cancel(nil)
	w.stopDeadline()
}

// readInto fills c from r, paced by the download limit, telling c's
// relays of each relayPiece.
func (s *Swarm) readInto(ctx context.Context, watch *transferWatch, r io.Reader, c *liveChunk) error {
	buf := c.data()
	n := int64(len(buf))
	for off := int64(0); off < n; {
		k := min(n-off, relayPiece)
		if s.download != nil {
			if err := s.download.WaitN(ctx, int(k)); err != nil {
				return err
			}
		}
		watch.progress()
		if got, err := io.ReadFull(r, buf[off:off+k]); err != nil {
			if ctx.Err() != nil {
				err = context.Cause(ctx) // the deadline, or errStalled
			}
			timedOut := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errStalled)
			if off+int64(got) > 0 && timedOut {
				// Bytes came, too slowly: a busy peer, not a dead one.
				return fmt.Errorf("%w: %d of %d bytes in time: %w", errSlow, off+int64(got), n, err)
			}
			return fmt.Errorf("reading at byte %d of %d: %w", off, n, err)
		}
		off += k
		c.progress(off)
	}
	return nil
}
