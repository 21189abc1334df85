package p2p

import (
	"context"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
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
	"github.com/weightd/weightd/pkg/content"
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
	MaxInFlight    int           // chunk requests in flight per blob, all sources together (default 8, and at most 128 MiB of chunks)
	PerPeer        int           // requests in flight to one peer (default 2)
	OriginInFlight int           // requests in flight to the origin per fill (default: originRequests, 3 or 2 by the node's fills)
	OriginFetchers int           // nodes that fetch one blob from the origin, each a share of its chunks (default 2)
	MaxFollowed    int           // holders of a blob whose chunk states one download reads, and whom it asks for chunks (default 24; follow.go)
	Refresh        time.Duration // the most time between two reads of one holder's chunk state, and a busy peer's backoff (default 50ms); less where chunks come in a few Refreshes (refreshEvery); each read waits at the holder for news
	Settle         time.Duration // how long to let gossip settle before taking the origin role (default 1s)
	BanFor         time.Duration // how long a lying or failing peer is shunned (default 5m)
	OriginLinger   time.Duration // how long peers still see the origin role after a fill ends (default 1m)
	// Now is the clock of the swarm's decisions (election, picking, backoff,
	// bans), so that they can be driven in tests and simulations; nil is
	// time.Now. Network timeouts keep the real clock.
	Now func() time.Time
	// Rand is the source of the swarm's random choices (the order of
	// chunks equally rare, which holders to follow, which of equal
	// suppliers to ask), so that a simulation's seed repeats its run;
	// nil is the runtime's.
	Rand          rand.Source
	MinRate       int64 // the slowest acceptable transfer of one fill, bytes/s: request timeouts scale with it and with the fills running (default 256 KiB/s; a transfer that stalls for 5 s ends sooner)
	DownloadLimit int64 // bytes/s for all chunk downloads together; 0 means no limit
	// OriginLimit is bytes/s each origin may send the whole cluster, the
	// same on every node; each paces its reads of an origin at its part of
	// that origin's limit (originlimit.go). 0 means no limit.
	OriginLimit int64
	// OriginLimits overrides OriginLimit for the origins it names
	// (Origin.Name); 0 there means no limit for that origin.
	OriginLimits map[string]int64
	// PublishOriginFetches, with an origin limit set, is told how many
	// blobs this node fetches from each limited origin for the cluster
	// whenever that changes, to gossip as NodeMeta.OriginFetches
	// (Membership.SetOriginFetches). It must not block or change counts.
	PublishOriginFetches func(counts map[OriginKey]int)
	// Zone is this node's topology zone (NodeMeta.Zone): peers of its zone
	// are preferred, and chunks cross into it about once (zone.go).
	Zone string
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
	def(&c.OriginFetchers, 2)
	def(&c.MaxFollowed, 24)
	if c.Refresh <= 0 {
		c.Refresh = 50 * time.Millisecond
	}
	if c.Settle <= 0 {
		c.Settle = time.Second
	}
	if c.BanFor <= 0 {
		c.BanFor = 5 * time.Minute
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.OriginLinger <= 0 {
		c.OriginLinger = time.Minute
	}
	if c.MinRate <= 0 {
		c.MinRate = 256 << 10
	}
	return c
}

// severalFills reports whether the node fills several blobs at once (an
// image's layers), whose chunks share its downlink.
func (s *Swarm) severalFills() bool { return s.fills.Load() > 1 }

// bufferRoom reports whether the chunk buffers of all fills leave room
// for n more bytes. Fills that check at once may pass it together by a
// chunk each.
func (s *Swarm) bufferRoom(n int64) bool { return s.buffered.Load()+n <= bufferBytes }

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
	rand     *rand.Rand // from SwarmConfig.Rand

	requestsTo sync.Map     // peer name → *atomic.Int32: this node's chunk requests in flight to it, over all fills
	buffered   atomic.Int64 // bytes of the chunk buffers all fills' requests in flight need
	fills      atomic.Int32 // fills running (severalFills, requestTimeout)
	received   atomic.Int64 // chunk bytes received, from peers and origins, for downlink

	downMu   sync.Mutex
	downlink paceMeter

	mu        sync.Mutex
	bans      map[string]time.Time
	origin    map[digest.Digest]originHold // blobs this node fetches from the origin for the cluster
	live      liveChunks                   // chunks on their way here, which the chunk server relays
	origins   map[string]*originPart       // the limited origins this node reads, by name
	published map[OriginKey]int            // this node's counts of origin fetches last published
	cluster   map[OriginKey]int            // the other members' gossiped counts (clusterFetches)
	clusterAt time.Time                    // when cluster was summed
}

type swarmMetrics struct {
	received   *prometheus.CounterVec
	latency    *prometheus.HistogramVec
	bans       *prometheus.CounterVec
	mismatches prometheus.Counter
	originRole prometheus.Counter
	crossZone  prometheus.Counter
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
	s := &Swarm{dir: dir, client: client, cfg: cfg, download: newLimiter(cfg.DownloadLimit),
		log: log, rand: newRand(cfg.Rand), bans: map[string]time.Time{}, origin: map[digest.Digest]originHold{}, origins: map[string]*originPart{}}
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
		crossZone: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_p2p_cross_zone_bytes_total", Help: "Chunk bytes received from peers of another zone (--zone), endgame duplicates included.",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{s.m.received, s.m.latency, s.m.bans, s.m.mismatches, s.m.originRole, s.m.crossZone} {
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
func (s *Swarm) Source(desc content.Descriptor, origin Origin) content.RangeOpener {
	src := &swarmSource{s: s, desc: desc, origin: origin}
	src.want.Store(-1)
	return src
}

type swarmSource struct {
	s      *Swarm
	desc   content.Descriptor
	origin Origin
	want   atomic.Int64 // the byte a reader waits on; -1 for none
}

// Want says that a reader waits on byte off of the blob.
func (src *swarmSource) Want(off int64) { src.want.Store(off) }

func (src *swarmSource) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	return src.s.Paced(src.origin).OpenRange(ctx, off)
}

// Paced returns origin with its reads paced by DownloadLimit and this
// node's part of the origin's limit, for what a node streams from the
// origin outside the swarm's chunks (a blob read in order, every blob
// while it has no peers): the limits are over everything. origin's reader
// itself when there is no limit.
func (s *Swarm) Paced(origin Origin) content.RangeOpener {
	limits := slices.DeleteFunc([]*rate.Limiter{s.download, s.originPace(origin.Name)}, func(l *rate.Limiter) bool { return l == nil })
	if len(limits) == 0 {
		return origin.RangeOpener
	}
	return pacedOpener{origin: origin, limits: limits}
}

// pacedOpener is an origin whose readers wait for limits.
type pacedOpener struct {
	origin Origin
	limits []*rate.Limiter
}

func (p pacedOpener) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	body, err := p.origin.OpenRange(ctx, off)
	if err != nil {
		return nil, err
	}
	return &pacedReader{ReadCloser: body, ctx: ctx, limits: p.limits}, nil
}

// pacedReader takes each read's bytes from its limits once they are read,
// so the count is exact; a read asks for at most relayPiece, well within
// a limit's burst.
type pacedReader struct {
	io.ReadCloser
	ctx    context.Context
	limits []*rate.Limiter
}

func (r *pacedReader) Read(b []byte) (int, error) {
	n, err := r.ReadCloser.Read(b[:min(len(b), relayPiece)])
	if n > 0 {
		for _, l := range r.limits {
			if werr := l.WaitN(r.ctx, n); werr != nil {
				return n, werr
			}
		}
	}
	return n, err
}

// maxInFlightBytes bounds the chunk buffers one download holds, and
// bufferBytes those of all of a node's downloads together, so memory stays
// flat whatever the chunk size and however many blobs are fetched at
// once. A download alone keeps MaxInFlight 16 MiB chunks in flight: with
// fewer, its requests wait on busy uploaders and its link idles
// (docs/swarm-tuning.md).
const (
	maxInFlightBytes = 128 << 20
	bufferBytes      = 512 << 20
)

// smallBlob is the largest blob fetched without the swarm's election when
// it fits in one chunk (configs, manifests, small layers): a copy per node
// costs the origin little, and an election costs seconds under load.
const smallBlob = 1 << 20

func (src *swarmSource) Fill(ctx context.Context, p *cache.Partial) error {
	if p.Chunks() == 1 && p.Descriptor().Size <= smallBlob {
		return src.s.fillSmall(ctx, p, src.origin)
	}
	f := &fill{plan: src.s.newPlan(p.Descriptor(), p.ChunkSize(), &src.want), p: p, origin: src.origin,
		supplier: map[int]string{}, results: make(chan chunkResult, src.s.cfg.MaxInFlight*2), states: make(chan stateResult, 64),
		hashQueries: make(chan hashQuery, src.s.cfg.MaxInFlight*2)}
	return f.run(ctx)
}

// fillSmall fetches a blob of one small chunk without the swarm's
// election: from a peer that holds it whole, else from the origin. Its one
// chunk is the whole blob, so the blob's digest checks whoever sent it.
func (s *Swarm) fillSmall(ctx context.Context, p *cache.Partial, origin Origin) error {
	d := p.Descriptor().Digest
	want, err := hex.DecodeString(d.Encoded())
	if err != nil || d.Algorithm() != digest.SHA256 {
		return fmt.Errorf("%w: digest %s", content.ErrInvalid, d)
	}
	n := p.ChunkLen(0)
	timeout := s.requestTimeout(n, false)
	for _, h := range s.dir.Holders(d) {
		if !h.Complete || h.Peer == s.dir.LocalName() || s.Banned(h.Peer) {
			continue
		}
		peer, ok := s.dir.Peer(h.Peer)
		if !ok || peer.Meta.ChunkAddr == "" {
			continue
		}
		c := newLiveChunk(n)
		_, err := s.fetchChunk(ctx, peer.Meta.ChunkAddr, d, 0, timeout, false, false, c)
		if err == nil {
			err = p.WritePeerChunk(0, c.data(), want)
		}
		c.release()
		if err == nil {
			s.m.received.WithLabelValues("peer").Add(float64(n))
			return nil
		}
		if errors.Is(err, content.ErrDigestMismatch) {
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
	if err := s.fetchOrigin(ctx, origin, 0, c); err != nil {
		return err
	}
	if err := p.WriteChunk(0, c.data(), want); err != nil {
		return fmt.Errorf("blob %s from the origin: %w", d, err)
	}
	s.m.received.WithLabelValues("origin").Add(float64(n))
	return nil
}

// FetchesFromOrigin reports whether this node is fetching d from the origin
// for the cluster, or did until less than OriginLinger ago; the chunk server
// tells peers (WithSwarm).
func (s *Swarm) FetchesFromOrigin(d digest.Digest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	h, ok := s.origin[d]
	return ok && (h.holds > 0 || s.cfg.Now().Before(h.until))
}

// originHold is this node's origin role for one blob: the fills that hold
// it, and until when peers still see it once the last has let go. A
// deadline on the swarm's clock, not a timer: nothing outlives the fill, and
// a later fill's hold is never cleared by an earlier one's lingering.
type originHold struct {
	holds int
	until time.Time
}

// setOrigin takes (on) or gives back one hold on the origin role for d.
// Giving back keeps the role visible for linger once no hold is left: a
// fill that ended will soon say complete, and peers should not elect
// another fetcher meanwhile. A node that yields the role gives linger 0:
// the other fetchers split the chunks among themselves at once. Roles
// past their linger are forgotten here.
func (s *Swarm) setOrigin(d digest.Digest, on bool, linger time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.cfg.Now()
	h := s.origin[d]
	if on {
		h.holds++
	} else if h.holds > 0 {
		h.holds--
		h.until = now.Add(linger)
	}
	s.origin[d] = h
	for k, o := range s.origin {
		if o.holds == 0 && !now.Before(o.until) {
			delete(s.origin, k)
		}
	}
}

// Banned reports whether peer is shunned now.
func (s *Swarm) Banned(peer string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cfg.Now().Before(s.bans[peer])
}

func (s *Swarm) ban(peer, reason string) {
	s.mu.Lock()
	now := s.cfg.Now()
	already := now.Before(s.bans[peer])
	s.bans[peer] = now.Add(s.cfg.BanFor)
	s.mu.Unlock()
	if already {
		return // several requests in flight failed the same way
	}
	s.m.bans.WithLabelValues(reason).Inc()
	s.log.Warn("banning peer", "peer", peer, "reason", reason, "for", s.cfg.BanFor)
}

// sourceOf is the metric label of a chunk's supplier.
func sourceOf(supplier string) string {
	if supplier == "" {
		return "origin"
	}
	return "peer"
}
