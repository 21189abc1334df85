// Package swarmsim simulates a cluster of weightd nodes filling one blob
// through the swarm, at sizes no test bed reaches. Each node's decisions
// are the real ones (p2p.Planner: origin election and shares, picking,
// supplier choice, holdoff, endgame, backoff and bans); the network, the
// chunk servers, membership and the origin are modelled here, with no
// chunk bytes: a node is a few bitmaps.
//
// The network is fluid: every transfer is a flow from one node's uplink (or
// the origin's) to another's downlink, the links' capacity shared max-min
// fair among their flows, recomputed every Step (half of Refresh, the
// fill loop's tick, or an eighth of a chunk's time on a fast link).
// Requests, their answers and state reads take their round trips between
// steps, and a node's fill loop runs at each answer it gets, as the
// agent's does (withinStep). A relayed chunk's bytes go no further than
// the relay has received, less one relay piece, until the relay has the
// chunk whole. Links carry payload at 1/HeaderOverhead of their rate.
// State reads are long-polls as the chunk server answers them: at once
// when the holder's state differs from the one the reader knows, else at
// the first of its looks (every PlanStatePoll) that finds news, or after
// PlanStateWait; their bytes are counted and taken out of the links.
// Gossip (holders, deaths) reaches each node after its own delay, drawn
// from a distribution fitted to real memberlist (gossipDelay), and its
// bytes are those of a model fitted to it too (gossipBytes).
package swarmsim

import (
	"cmp"
	"container/heap"
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/p2p"
)

// Config is one simulated fill of a blob by a cluster. The zero value of a
// field means its default.
type Config struct {
	Nodes          int
	Size           int64         // the blob's bytes
	ChunkSize      int64         // default cache.DefaultChunkSize
	Link           float64       // every node's link, bytes/s each way (default 100 Mbit/s)
	OriginLink     float64       // the origin's uplink, bytes/s (default Link)
	Latency        time.Duration // one way, between any two hosts (default 0.5 ms)
	HeaderOverhead float64       // link bytes per payload byte (default 1.046: TCP/IP headers, as measured by bench/swarm)
	SlowFraction   float64       // nodes whose links run at SlowFactor of Link
	SlowFactor     float64       // default 0.25
	KillFraction   float64       // nodes killed when they hold a random 20–80% of the blob
	LateFraction   float64       // nodes that start their fill late, uniformly within LateWindow of S/B
	LateWindow     float64       // default 0.5
	Liars          int           // nodes whose chunks never match
	Seeders        int           // nodes that hold the whole blob from the start (pulled before; no faults), known to all as complete holders
	Zones          int           // zones the nodes lie in, node i in zone i mod Zones, each told its zone (SwarmConfig.Zone); 0 or 1: none
	ZonesUntold    bool          // the nodes are not told their zones: the same cluster without zone-aware choice
	StreamRate     float64       // a reader on each filling node takes the blob in order at most at this many bytes/s, as the registry mirror streams it to containerd, and says which byte it waits on (Planner.Want); a node is done when its reader is. 0: no reader
	MaxUploads     int           // a chunk server's uploads at once (default 6, the agent's)
	Step           time.Duration // the network's time step (default the fill loop's tick, Refresh/2, at most 25 ms and an eighth of a chunk's time on Link)
	Swarm          p2p.SwarmConfig
	Seed           uint64
}

// Result is what a simulation measured; time ratios are per filling node.
type Result struct {
	Nodes, Finished, Killed, Seeders int
	LimitS                           float64       // S/B of a link of Config.Link
	Refresh, Step                    time.Duration // SwarmConfig.Refresh and Config.Step, defaults filled in
	TimeRatioP50                     float64       // T/(S/B), T from the node's start
	TimeRatioP99                     float64
	TimeRatioMax                     float64
	SlowTimeRatioP50                 float64 // the slow tail's own, over its own link's S/B
	FastTimeRatioP99                 float64 // the other nodes'
	OriginRatio                      float64 // origin bytes / S
	SeedRatio                        float64 // bytes each seeder sent / S, on average (Config.Seeders)
	OriginDoneRatio                  float64 // when the origin sent its last byte, over S/B
	RelayedBytesPerNode              float64 // bytes a node sent to peers, on average
	RefusedPerNodeS                  float64 // chunk requests refused as busy (slots full, or the requester's share of them), per node per second of its fill
	SchedCPUPerNode                  float64 // seconds in the decision code per node
	StateBytesPerNodeS               float64 // state-read bytes (both ways) per node per second of its fill
	StateReadsPerNodeS               float64
	GossipBytesPerNodeS              float64 // membership gossip over the run, from a model of memberlist (gossip.go)
	ZoneInRatio                      float64 // with Config.Zones: the most bytes that reached one zone from outside it (the origin and other zones), over S
	SimulatedS                       float64
	BannedLiar                       int // nodes that banned a liar
	BannedHonest                     int // bans of live peers that never lied, held at the end: false alarms
	// Origin fetchers: nodes that got a tenth of the blob or more from
	// the origin, and how many of them were slow, killed or lying.
	Fetchers, SlowFetchers, KilledFetchers, LyingFetchers int
}

func (c Config) withDefaults() Config {
	if c.ChunkSize <= 0 {
		c.ChunkSize = cache.DefaultChunkSize
	}
	if c.Link <= 0 {
		c.Link = 100e6 / 8
	}
	if c.OriginLink <= 0 {
		c.OriginLink = c.Link
	}
	if c.Latency <= 0 {
		c.Latency = 500 * time.Microsecond
	}
	if c.HeaderOverhead <= 0 {
		c.HeaderOverhead = 1.046
	}
	if c.SlowFactor <= 0 {
		c.SlowFactor = 0.25
	}
	if c.LateWindow <= 0 {
		c.LateWindow = 0.5
	}
	if c.MaxUploads <= 0 {
		c.MaxUploads = 6
	}
	if c.Swarm.Refresh <= 0 {
		c.Swarm.Refresh = 50 * time.Millisecond
	}
	if c.Step <= 0 {
		// A transfer's end is seen at the step after it: a step of an
		// eighth of a chunk's time on the link keeps that lag small.
		chunkTime := time.Duration(float64(c.ChunkSize) / c.Link * float64(time.Second))
		c.Step = min(c.Swarm.Refresh/2, 25*time.Millisecond, chunkTime/8)
	}
	return c
}

// Wire sizes of a state read: the HTTP request and response around the
// state (a guess at headers and TLS framing), and the encoded state's
// header (pkg/p2p/state.go).
const (
	stateRequestBytes  = 300
	stateResponseBytes = 200
	stateHeaderBytes   = 22
)

var errRefused = errors.New("connection refused")

type node struct {
	idx                int
	name               string
	zone, told         string // the zone it lies in ("" without Config.Zones), and the one it is told
	swarm              *p2p.Swarm
	plan               *p2p.Planner
	up, down           float64
	start, done        time.Duration // done 0: not yet
	started, dead      bool
	liar               bool
	seed               bool          // held the blob from the start (Config.Seeders)
	read               float64       // bytes its reader took (Config.StreamRate)
	readDone           time.Duration // when its reader took the last byte, from its start; 0: not yet
	killAt             int           // chunks held when it is killed; 0 never
	have, sent, fetch  []byte
	nhave, nfetch      int
	nsent              int
	origin             bool
	snap               *p2p.PeerState // its state as served, until it changes
	key                stateKey
	changed            bool
	waiting            []read             // state reads waiting here for news
	known              []stateKey         // per holder: the state it last read of it
	incoming           map[int]*flow      // chunk → the first transfer of it here
	uploads            map[*flow]struct{} // chunk uploads being served
	uploadsTo          map[int]int        // requester → uploads
	recent             map[int]*sentOnce  // chunks sent once as an origin fetcher
	repeating          bool               // an origin fetcher's one repeat is being sent
	stateUp, stateDown float64            // state bytes this step
	upUsed, downUsed   float64            // state bytes last step, taken off the links
	cpu                time.Duration      // in the decision code
	stateBytes         int64              // state reads, both ways, for its own fill
	stateReads         int64
	relayed            int64
	refused            int // its chunk requests refused as busy
	missingBuf         []int
	visible            bool          // members see it
	holders            []p2p.Holder  // the others that gossip told it hold the blob
	ban                bool          // it banned a liar
	fromOrigin         float64       // bytes it got from the origin
	woke               bool          // a result or state came since its loop last ran
	ran                time.Duration // when its loop last ran
}

// stateKey is what a chunk server compares to the requester's word to
// tell news: chunks held, chunks on their way, the origin role, and an
// origin fetcher's sends.
type stateKey struct {
	have, fetch, sent int
	origin, complete  bool
	valid             bool
}

type read struct {
	from        *node
	look, until time.Duration // the server's next look for news, and when it answers without any
}

type flow struct {
	from, to *node // from nil: the origin
	req      p2p.PlanRequest
	size     float64
	got      float64
	rate     float64
	began    time.Duration
	upstream *flow // a relay's: the transfer bringing the chunk to from
	done     bool
	failed   bool
	repeat   bool // an origin fetcher's repeat
	frozen   bool
	late     time.Duration // how far into the step it began: its first step moves it for the rest
	paceLink int           // its own link in sim.links, capped at a relay's pace; -1: none
}

type event struct {
	at  time.Duration
	seq int
	do  func()
}

type events []event

func (e events) Len() int { return len(e) }
func (e events) Less(i, j int) bool {
	return e[i].at < e[j].at || (e[i].at == e[j].at && e[i].seq < e[j].seq)
}
func (e events) Swap(i, j int) { e[i], e[j] = e[j], e[i] }
func (e *events) Push(x any)   { *e = append(*e, x.(event)) }
func (e *events) Pop() any {
	old := *e
	x := old[len(old)-1]
	*e = old[:len(old)-1]
	return x
}

type sim struct {
	cfg        Config
	rng        *rand.Rand
	desc       content.Descriptor
	chunks     int
	now        time.Duration
	stepAt     time.Duration // the start of the step under way
	woken      []*node       // nodes a result or state came to since their loop last ran
	epoch      time.Time
	nodes      []*node
	byName     map[string]*node
	flows      []*flow
	queue      events
	seq        int
	origin     float64            // bytes the origin sent
	zoneIn     map[string]float64 // bytes that reached each zone from outside it
	originLast time.Duration      // when it last sent a byte
	members    []p2p.Peer         // visible members, twice over: node i's others are a window of it
	place      map[string]int
	step       time.Duration
	events     int    // gossip events: holders' announcements, completions, deaths
	links      []link // per node its uplink (2i) and downlink (2i+1), then the origin's
	heap       linkHeap
}

func (s *sim) at(d time.Duration, do func()) {
	s.seq++
	heap.Push(&s.queue, event{at: s.now + d, seq: s.seq, do: do})
}

// Run simulates cfg.Nodes nodes filling one blob of cfg.Size bytes.
func Run(cfg Config) (Result, error) {
	// The decision code's CPU time is this thread's: the simulation runs
	// on one goroutine, pinned to it.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cfg = cfg.withDefaults()
	if cfg.Nodes < 1 || cfg.Size < cfg.ChunkSize || cfg.Seeders < 0 || cfg.Seeders >= cfg.Nodes {
		return Result{}, fmt.Errorf("swarmsim: %d nodes (%d seeders), a blob of %d bytes in chunks of %d", cfg.Nodes, cfg.Seeders, cfg.Size, cfg.ChunkSize)
	}
	s := &sim{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 1)), byName: map[string]*node{}, zoneIn: map[string]float64{},
		epoch: time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC), step: cfg.Step}
	s.desc = content.Descriptor{Digest: digest.FromString("swarmsim " + strconv.FormatUint(cfg.Seed, 10)), Size: cfg.Size}
	s.chunks = int((cfg.Size + cfg.ChunkSize - 1) / cfg.ChunkSize)
	limit := float64(cfg.Size) / cfg.Link
	perm := s.rng.Perm(cfg.Nodes)
	fillers := cfg.Nodes - cfg.Seeders
	nSlow, nKill, nLate := frac(fillers, cfg.SlowFraction), frac(fillers, cfg.KillFraction), frac(fillers, cfg.LateFraction)
	sc := cfg.Swarm
	sc.Now = func() time.Time { return s.epoch.Add(s.now) }
	bmap := (s.chunks + 7) / 8
	for i := range cfg.Nodes {
		n := &node{idx: i, name: fmt.Sprintf("node-%d", i), up: cfg.Link, down: cfg.Link,
			have: make([]byte, bmap), sent: make([]byte, bmap), fetch: make([]byte, bmap),
			known: make([]stateKey, cfg.Nodes), incoming: map[int]*flow{}, uploads: map[*flow]struct{}{}, uploadsTo: map[int]int{}, recent: map[int]*sentOnce{}}
		if cfg.Zones > 1 {
			n.zone = fmt.Sprintf("zone-%d", i%cfg.Zones)
			if !cfg.ZonesUntold {
				n.told = n.zone
			}
		}
		s.nodes = append(s.nodes, n)
		s.byName[n.name] = n
	}
	// Roles by places in a random permutation: the seeders last, and of
	// the others the slow tail first, then the killed (half of them from
	// the slow tail), the liars, and the late from the end.
	for _, i := range perm[fillers:] {
		n := s.nodes[i]
		n.seed, n.started, n.nhave = true, true, s.chunks
		for c := range s.chunks {
			n.have = setBit(n.have, c)
		}
	}
	for k, i := range perm[:fillers] {
		n := s.nodes[i]
		if k < nSlow {
			n.up, n.down = cfg.Link*cfg.SlowFactor, cfg.Link*cfg.SlowFactor
		}
		if k >= nSlow/2 && k < nSlow/2+nKill {
			n.killAt = max(1, int(float64(s.chunks)*(0.2+0.6*s.rng.Float64())))
		}
		if k >= fillers-nLate {
			n.start = time.Duration(s.rng.Float64() * cfg.LateWindow * limit * float64(time.Second))
		}
		if k >= nKill+nSlow && k < nKill+nSlow+cfg.Liars {
			n.liar = true
		}
	}
	for i, n := range s.nodes {
		sc.Rand = rand.NewPCG(cfg.Seed, 2+uint64(i)) // each node its own stream: a seed repeats the run
		sc.Zone = n.told
		sw, err := p2p.NewSwarm(simDir{s: s, n: n}, nil, sc, nil, nil)
		if err != nil {
			return Result{}, err
		}
		n.swarm = sw
		if !n.seed {
			s.at(n.start, func() { s.startFill(n) })
		}
	}
	// Gossip told every node of the seeders long before.
	for _, sd := range s.nodes {
		if sd.seed {
			for _, n := range s.nodes {
				if !n.seed {
					n.holders = append(n.holders, p2p.Holder{Peer: sd.name, Complete: true})
				}
			}
		}
	}
	// Every member is up from the start; a late node only starts its
	// fill late.
	for _, n := range s.nodes {
		n.visible = true
	}
	s.rebuildMembers()

	deadline := time.Duration(20*limit*float64(time.Second)) + time.Minute
	for s.now = 0; s.now < deadline; s.now += s.step {
		s.stepAt = s.now
		for len(s.queue) > 0 && s.queue[0].at <= s.now {
			heap.Pop(&s.queue).(event).do()
		}
		s.transfer()
		s.stream()
		s.answerReads()
		if s.allDone() {
			break
		}
		// A fill's loop runs at each result or state it gets, and at its
		// tick, Refresh/2.
		for _, n := range s.nodes {
			if n.woke || s.now-n.ran >= cfg.Swarm.Refresh/2 {
				s.runLoop(n)
			}
			n.refreshKey(s.desc.Digest)
		}
		s.woken = s.woken[:0]
		s.withinStep()
	}
	return s.result(limit)
}

// withinStep carries out the events that come before the next step at
// their own times (answers to requests and state reads, transfers that
// begin), and runs the loop of each node they wake at once, as the agent's
// fill loop runs at each result or state it gets: a refused request is
// asked elsewhere a round trip later, not a step later. Bytes still move
// a step at a time (transfer); a transfer that begins within the step
// moves for the rest of it.
func (s *sim) withinStep() {
	next := s.stepAt + s.step
	for len(s.queue) > 0 && s.queue[0].at < next {
		e := heap.Pop(&s.queue).(event)
		s.now = max(s.now, e.at)
		e.do()
		for len(s.woken) > 0 {
			n := s.woken[0]
			s.woken = s.woken[1:]
			if n.woke {
				s.runLoop(n)
			}
		}
	}
	s.now = s.stepAt
}

// wake says a result or state came to n: its loop runs.
func (s *sim) wake(n *node) {
	if !n.woke {
		n.woke = true
		s.woken = append(s.woken, n)
	}
}

// runLoop runs n's fill loop once, if it is filling.
func (s *sim) runLoop(n *node) {
	n.woke = false
	if n.started && !n.seed && !n.dead && n.done == 0 {
		n.ran = s.now
		s.plan(n)
	}
}

func frac(n int, f float64) int { return int(math.Round(float64(n) * f)) }

func (s *sim) allDone() bool {
	for _, n := range s.nodes {
		if !n.seed && !n.dead && (n.done == 0 || (s.cfg.StreamRate > 0 && n.readDone == 0)) {
			return false
		}
	}
	return true
}

// stream moves each reader (Config.StreamRate) over the chunks its node
// holds in a row, as the registry mirror sends them: the last one only
// once the blob is whole and verified. A reader that waits says so to the
// fill.
func (s *sim) stream() {
	if s.cfg.StreamRate <= 0 {
		return
	}
	for _, n := range s.nodes {
		if !n.started || n.seed || n.dead || n.readDone != 0 {
			continue
		}
		end := float64(s.cfg.Size)
		if n.done == 0 {
			i := int(n.read) / int(s.cfg.ChunkSize)
			for i < s.chunks-1 && bitSet(n.have, i) {
				i++
			}
			end = float64(int64(i) * s.cfg.ChunkSize)
		}
		n.read = math.Min(end, n.read+s.cfg.StreamRate*s.step.Seconds())
		switch {
		case n.read >= float64(s.cfg.Size):
			n.readDone = s.now - n.start
		case n.done == 0 && n.read >= end:
			n.plan.Want(int64(n.read))
		}
	}
}

// startFill begins n's fill: gossip tells each other node it holds the
// blob, partially, after that node's delay.
func (s *sim) startFill(n *node) {
	n.started, n.changed = true, true
	n.plan = n.swarm.Planner(s.desc, s.cfg.ChunkSize)
	s.events++
	type reveal struct {
		at time.Duration
		to *node
	}
	var rs []reveal
	for _, o := range s.nodes {
		if o != n {
			rs = append(rs, reveal{s.now + gossipDelay(s.cfg.Nodes, s.rng.Float64()), o})
		}
	}
	slices.SortFunc(rs, func(a, b reveal) int { return cmp.Compare(a.at, b.at) })
	// One event at a time in the queue, revealing in order.
	var next func()
	next = func() {
		for len(rs) > 0 && rs[0].at <= s.now {
			if !n.dead {
				rs[0].to.holders = append(rs[0].to.holders, p2p.Holder{Peer: n.name})
			}
			rs = rs[1:]
		}
		if len(rs) > 0 && !n.dead {
			s.at(rs[0].at-s.now, next)
		}
	}
	s.at(rs[0].at-s.now, next)
}

// kill ends n: its transfers fail, and membership drops it after its
// failure is detected (a probe, then suspicion: memberlist's
// SuspicionMult 4 × log10(N) probe intervals of 1 s).
func (s *sim) kill(n *node) {
	n.dead = true
	for _, f := range s.flows {
		if !f.done && (f.from == n || f.to == n) {
			s.fail(f, errRefused)
		}
	}
	s.events++
	detect := time.Second + time.Duration(4*math.Max(1, math.Log10(float64(s.cfg.Nodes)))*float64(time.Second)) + gossipDelay(s.cfg.Nodes, s.rng.Float64())
	s.at(detect, func() {
		n.visible = false
		for _, o := range s.nodes {
			o.holders = slices.DeleteFunc(o.holders, func(h p2p.Holder) bool { return h.Peer == n.name })
		}
		s.rebuildMembers()
	})
}

// rebuildMembers lays the visible members out twice in a row, so that
// each node's others are one window of it, shared by all.
func (s *sim) rebuildMembers() {
	var live []p2p.Peer
	s.place = map[string]int{}
	for _, n := range s.nodes {
		if n.visible {
			s.place[n.name] = len(live)
			live = append(live, n.peer())
		}
	}
	s.members = append(live, live...)
}

// simDir is one node's view of membership and holders.
type simDir struct {
	s *sim
	n *node
}

func (d simDir) LocalName() string { return d.n.name }

func (d simDir) Members() []p2p.Peer {
	live := len(d.s.members) / 2
	if i, ok := d.s.place[d.n.name]; ok {
		return d.s.members[i+1 : i+live]
	}
	return d.s.members[:live]
}

func (d simDir) Peer(name string) (p2p.Peer, bool) {
	n := d.s.byName[name]
	if n == nil || !n.visible {
		return p2p.Peer{}, false
	}
	return n.peer(), true
}

// peer is n as membership tells it.
func (n *node) peer() p2p.Peer {
	return p2p.Peer{Name: n.name, Meta: p2p.NodeMeta{ChunkAddr: n.name, Zone: n.told}}
}

func (d simDir) Holders(digest.Digest) []p2p.Holder { return d.n.holders }

// plan runs one pass of n's fill loop and carries out its decisions.
func (s *sim) plan(n *node) {
	n.missingBuf = n.missingBuf[:0]
	for i := range s.chunks {
		if !bitSet(n.have, i) {
			n.missingBuf = append(n.missingBuf, i)
		}
	}
	t0 := threadCPU()
	reads, reqs := n.plan.Step(n.missingBuf)
	n.cpu += threadCPU() - t0
	for _, name := range reads {
		s.readState(n, s.byName[name])
	}
	for _, r := range reqs {
		s.request(n, r)
	}
}

// readState sends n's read of h's state: it arrives after a latency and
// waits there for news.
func (s *sim) readState(n, h *node) {
	lat := s.cfg.Latency
	s.at(lat, func() {
		switch {
		case h.dead:
			s.at(lat, func() { s.stateRead(n, h, nil, errRefused) })
		case !h.started:
			s.at(lat, func() { s.stateRead(n, h, nil, fmt.Errorf("chunk state from %s: %w", h.name, p2p.ErrNotHeld)) })
		case n.known[h.idx] != h.key:
			s.answer(n, h)
		default:
			h.waiting = append(h.waiting, read{from: n, look: s.now + p2p.PlanStatePoll, until: s.now + p2p.PlanStateWait})
		}
	})
}

// answer sends h's state to n, counting its bytes: the hashes n does not
// know yet, and the bitmap of known ones while the blob has few enough
// chunks for it to ride in the request.
func (s *sim) answer(n, h *node) {
	st := h.state(s)
	bmap := len(st.Have)
	req := stateRequestBytes
	last := n.known[h.idx]
	hashes := h.nhave
	if last.valid && bmap <= p2p.PlanMaxKnownParam {
		req += base64.RawURLEncoding.EncodedLen(bmap)
		hashes -= last.have
	}
	resp := stateResponseBytes + stateHeaderBytes + bmap + 32*hashes
	for _, b := range [][]byte{st.Sent, st.Fetching} {
		if b != nil {
			resp += bmap
		}
	}
	if last.valid && bmap <= p2p.PlanMaxKnownParam {
		resp += bmap
	}
	n.known[h.idx] = h.key
	n.stateUp, n.stateDown = n.stateUp+float64(req), n.stateDown+float64(resp)
	h.stateDown, h.stateUp = h.stateDown+float64(req), h.stateUp+float64(resp)
	n.stateBytes += int64(req + resp)
	n.stateReads++
	s.at(s.cfg.Latency, func() { s.stateRead(n, h, st, nil) })
}

func (s *sim) stateRead(n, h *node, st *p2p.PeerState, err error) {
	if n.dead || n.done != 0 {
		return
	}
	var ps p2p.PeerState
	if st != nil {
		ps = *st
	}
	s.wake(n)
	t0 := threadCPU()
	n.plan.StateRead(h.name, ps, err)
	n.cpu += threadCPU() - t0
}

// answerReads answers the reads waiting at each holder that has news, and
// those that waited p2p.PlanStateWait.
func (s *sim) answerReads() {
	for _, h := range s.nodes {
		if len(h.waiting) == 0 {
			continue
		}
		keep := h.waiting[:0]
		for _, r := range h.waiting {
			if h.dead {
				s.at(s.cfg.Latency, func() { s.stateRead(r.from, h, nil, errRefused) })
				continue
			}
			if s.now >= r.until || (s.now >= r.look && r.from.known[h.idx] != h.key) {
				s.answer(r.from, h)
				continue
			}
			for r.look <= s.now {
				r.look += p2p.PlanStatePoll
			}
			keep = append(keep, r)
		}
		clear(h.waiting[len(keep):])
		h.waiting = keep
	}
}

// state is h's state as its chunk server serves it, shared by all who
// read it until it changes.
func (h *node) state(s *sim) *p2p.PeerState {
	if h.snap != nil {
		return h.snap
	}
	st := &p2p.PeerState{ChunkState: cache.ChunkState{Size: s.cfg.Size, ChunkSize: s.cfg.ChunkSize,
		Complete: h.nhave == s.chunks, Have: slices.Clone(h.have)}, Origin: h.origin}
	if h.nsent > 0 {
		// The server's word: chunks sent, relayed ones once held.
		st.Sent = make([]byte, len(h.sent))
		for i := range st.Sent {
			st.Sent[i] = h.sent[i] & h.have[i]
		}
	}
	if h.nfetch > 0 {
		st.Fetching = slices.Clone(h.fetch)
	}
	h.snap = st
	return st
}

// sentOnce is when an origin fetcher first sent a chunk, to whom last,
// and how often it sent it again since.
type sentOnce struct {
	at     time.Duration
	to     *node
	agains int
}

// refreshKey takes note of changes to n's state this step: readers
// waiting for news get it.
func (n *node) refreshKey(d digest.Digest) {
	origin := n.started && n.swarm.FetchesFromOrigin(d)
	if origin != n.origin {
		n.origin, n.changed = origin, true
	}
	if !n.changed {
		return
	}
	n.changed, n.snap = false, nil
	k := stateKey{have: n.nhave, fetch: n.nfetch, origin: n.origin, complete: n.done != 0 || n.seed, valid: true}
	if n.origin {
		k.sent = n.nsent
	}
	n.key = k
}

// request carries out n's request r: refused at once by a server that
// cannot serve it, else a transfer that starts after a round trip.
func (s *sim) request(n *node, r p2p.PlanRequest) {
	lat := s.cfg.Latency
	size := float64(s.chunkLen(r.Chunk))
	if r.Peer == "" {
		s.at(2*lat, func() { s.begin(&flow{to: n, req: r, size: size, began: s.now}) })
		return
	}
	h := s.byName[r.Peer]
	s.at(lat, func() {
		var err error
		f := &flow{from: h, to: n, req: r, size: size}
		switch {
		case h.dead:
			err = errRefused
		case bitSet(h.have, r.Chunk):
		case h.incoming[r.Chunk] != nil:
			f.upstream = h.incoming[r.Chunk]
		default:
			err = fmt.Errorf("chunk %d: %w", r.Chunk, p2p.ErrNotHeld)
		}
		held := s.slotsHeld(h)
		if err == nil && (held >= s.cfg.MaxUploads || len(h.uploads) >= 2*s.cfg.MaxUploads || h.uploadsTo[n.idx] >= (s.cfg.MaxUploads+1)/2) {
			err = p2p.ErrPeerBusy
		}
		if err == nil && h.origin {
			switch sent := h.recent[r.Chunk]; {
			case sent != nil && s.now-sent.at < p2p.PlanResendAfter && r.Again && p2p.SendsAgain(sent.to.name, n.name, sent.agains):
				sent.to = n // a new receiver, in the same window
				sent.agains++
			case sent != nil && s.now-sent.at < p2p.PlanResendAfter:
				if held > s.cfg.MaxUploads/2 || h.repeating {
					err = p2p.ChunkSentTo(sent.to.name)
				} else {
					h.repeating, f.repeat = true, true
				}
			case !bitSet(h.sent, r.Chunk):
				h.recent[r.Chunk] = &sentOnce{at: s.now, to: n}
			}
		}
		// The asker's upload counts among those held, as in the agent,
		// where it has its slot by then.
		if err == nil && !h.origin && h.nhave == s.chunks && p2p.SendsOnce(s.uploadsOf(h, r.Chunk), held+1, s.cfg.MaxUploads, h.up) {
			err = p2p.ErrChunkSent
		}
		if errors.Is(err, p2p.ErrPeerBusy) {
			n.refused++
		}
		if err != nil {
			s.at(lat, func() { s.done(n, r, 2*lat, err) })
			return
		}
		if !bitSet(h.sent, r.Chunk) {
			h.sent = setBit(h.sent, r.Chunk)
			h.nsent++
			h.changed = true
		}
		h.uploads[f] = struct{}{}
		h.uploadsTo[n.idx]++
		f.began = s.now - lat
		// Until its first byte, the server holds the slot and the
		// transfer is not moving.
		f.frozen = true
		s.flows = append(s.flows, f)
		s.at(lat, func() { s.begin(f) })
	})
}

// begin starts moving f's bytes; the receiver says the chunk is on its way.
func (s *sim) begin(f *flow) {
	if f.to.dead || f.failed {
		return // a peer's transfer failed already, when its receiver died
	}
	f.frozen = false
	f.late = s.now - s.stepAt
	if f.from == nil {
		s.flows = append(s.flows, f)
	}
	i := f.req.Chunk
	if f.to.incoming[i] == nil && !bitSet(f.to.have, i) {
		f.to.incoming[i] = f
		f.to.fetch = setBit(f.to.fetch, i)
		f.to.nfetch++
		f.to.changed = true
	}
}

func (s *sim) release(f *flow) {
	h := f.from
	delete(h.uploads, f)
	if h.uploadsTo[f.to.idx]--; h.uploadsTo[f.to.idx] <= 0 {
		delete(h.uploadsTo, f.to.idx)
	}
	if f.repeat {
		h.repeating = false
	}
}

// slotsHeld is how many of h's upload slots its uploads hold, by the
// agent's rule (p2p.SlotsHeld), h's link standing for the pace the agent
// measures.
func (s *sim) slotsHeld(h *node) int {
	return p2p.SlotsHeld(s.uploadsOf(h, -1), h.up, s.cfg.MaxUploads)
}

// uploadsOf is h's uploads in progress: of chunk i, or of any (i < 0).
func (s *sim) uploadsOf(h *node, i int) []p2p.Upload {
	ups := make([]p2p.Upload, 0, len(h.uploads))
	for f := range h.uploads {
		if i < 0 || f.req.Chunk == i {
			ups = append(ups, p2p.Upload{Sent: int64(f.got), Size: int64(f.size), Running: s.now - f.began})
		}
	}
	return ups
}

func (s *sim) chunkLen(i int) int64 {
	return min(s.cfg.ChunkSize, s.cfg.Size-int64(i)*s.cfg.ChunkSize)
}

// fail ends f with err.
func (s *sim) fail(f *flow, err error) {
	if f.done {
		return
	}
	f.done, f.failed = true, true
	if f.from != nil {
		s.release(f)
	}
	s.unshare(f)
	if !f.to.dead {
		took := s.now - f.began
		s.at(s.cfg.Latency, func() { s.done(f.to, f.req, took, err) })
	}
}

// unshare stops f's receiver saying the chunk is on its way.
func (s *sim) unshare(f *flow) {
	i := f.req.Chunk
	if f.to.incoming[i] != f {
		return
	}
	delete(f.to.incoming, i)
	f.to.fetch = clearBit(f.to.fetch, i)
	f.to.nfetch--
	f.to.changed = true
}

func (s *sim) done(n *node, r p2p.PlanRequest, took time.Duration, err error) {
	if n.dead || n.done != 0 {
		return
	}
	if errors.Is(err, content.ErrDigestMismatch) {
		n.ban = true
	}
	s.wake(n)
	t0 := threadCPU()
	if e := n.plan.Done(r, took, err); e != nil {
		panic(fmt.Sprintf("swarmsim: %s gave up: %v", n.name, e)) // only a permanent origin error does, and the origin never fails
	}
	n.cpu += threadCPU() - t0
}

// transfer moves every flow's bytes for one step and ends those done.
func (s *sim) transfer() {
	live := s.flows[:0]
	for _, f := range s.flows {
		if !f.done {
			live = append(live, f)
		}
	}
	clear(s.flows[len(live):])
	s.flows = live
	s.share()
	dt := s.step.Seconds()
	for _, n := range s.nodes {
		n.upUsed, n.downUsed = n.stateUp/dt, n.stateDown/dt
		n.stateUp, n.stateDown = 0, 0
	}
	var finished []*flow
	for _, f := range s.flows {
		if f.frozen || f.done {
			continue
		}
		was := f.got
		f.got = min(f.size, f.got+f.rate*(dt-f.late.Seconds()))
		f.late = 0
		if f.relaying() {
			// A relay passes on what it has, but for the last piece.
			u := f.upstream
			if u.failed {
				s.fail(f, p2p.ErrRelayCut)
				continue
			}
			f.got = max(was, min(f.got, u.got-p2p.PlanRelayPiece))
		}
		if f.from == nil {
			s.origin += f.got - was
			s.originLast = s.now
			f.to.fromOrigin += f.got - was
		}
		if f.from == nil || f.from.zone != f.to.zone {
			s.zoneIn[f.to.zone] += f.got - was
		}
		if f.got >= f.size {
			finished = append(finished, f)
		} else if f.req.SlowEnds && p2p.CopyTooSlow(int64(f.got), s.now-f.began, f.to.down) {
			s.fail(f, p2p.ErrSlow) // the receiver's link stands for the downlink the agent measures
		}
	}
	for _, f := range finished {
		s.finish(f)
	}
	for _, n := range s.nodes {
		if n.started && !n.dead && n.killAt > 0 && n.nhave >= n.killAt {
			s.kill(n)
		}
	}
}

// finish ends a transfer that brought its whole chunk.
func (s *sim) finish(f *flow) {
	f.done = true
	n, i := f.to, f.req.Chunk
	if f.from != nil {
		s.release(f)
		f.from.relayed += int64(f.size)
		if f.from.liar {
			f.failed = true // its relays end short
			s.unshare(f)
			s.at(s.cfg.Latency, func() { s.done(n, f.req, s.now-f.began, content.ErrDigestMismatch) })
			return
		}
	}
	s.unshare(f)
	if !bitSet(n.have, i) {
		n.have = setBit(n.have, i)
		n.nhave++
		n.changed = true
		// Other transfers of it here are endgame duplicates; the relays
		// of the first now read the chunk whole.
		if g := n.incoming[i]; g != nil {
			s.unshare(g)
		}
	}
	took := s.now - f.began
	s.done(n, f.req, took, nil)
	if n.nhave == s.chunks && n.done == 0 {
		n.done = s.now - n.start
		s.events++ // EventComplete: counted, not shown to the others
		n.plan.Release()
		n.changed = true
		for _, g := range s.flows {
			if g.to == n && !g.done {
				g.done = true // endgame duplicates, cancelled
				if g.from != nil {
					s.release(g)
				}
			}
		}
	}
}

// share sets each flow's rate: links max-min fair among their flows, by
// progressive filling. The link with the least share per unfixed flow
// fixes its flows at that share, and their other links lose it; a link's
// share only grows as others fix its flows, so a heap of stale shares,
// checked when popped, finds the next one. A relay can send no faster than
// its chunk reaches it, and TCP gives what such a flow leaves of its links
// to their other flows: it has a link of its own, capped at that pace
// (relayPace).
func (s *sim) share() {
	n := len(s.nodes)
	ls := s.links[:0]
	for range 2*n + 1 {
		ls = grown(ls)
	}
	ls[2*n].cap = s.cfg.OriginLink / s.cfg.HeaderOverhead
	for i, nd := range s.nodes {
		ls[2*i].cap = math.Max(0.1*nd.up, nd.up-nd.upUsed) / s.cfg.HeaderOverhead
		ls[2*i+1].cap = math.Max(0.1*nd.down, nd.down-nd.downUsed) / s.cfg.HeaderOverhead
	}
	// The paces read the upstream transfers' rates of the last step, so
	// they are taken before any rate is reset.
	for _, f := range s.flows {
		f.paceLink = -1
		if f.frozen || f.done {
			continue
		}
		if f.relaying() {
			ls = grown(ls)
			ls[len(ls)-1].cap = s.relayPace(f)
			f.paceLink = len(ls) - 1
		}
	}
	for _, f := range s.flows {
		if f.frozen || f.done {
			continue
		}
		f.rate = -1
		for _, e := range s.ends(f) {
			if e >= 0 {
				ls[e].flows = append(ls[e].flows, f)
				ls[e].left++
			}
		}
	}
	h := s.heap[:0]
	for i := range ls {
		if ls[i].left > 0 {
			h = append(h, linkShare{ls[i].cap / float64(ls[i].left), i})
		}
	}
	heap.Init(&h)
	for h.Len() > 0 {
		top := heap.Pop(&h).(linkShare)
		l := &ls[top.link]
		if l.left == 0 {
			continue
		}
		if share := l.cap / float64(l.left); share != top.share {
			heap.Push(&h, linkShare{share, top.link})
			continue
		}
		for _, f := range l.flows {
			if f.rate >= 0 {
				continue
			}
			f.rate = math.Max(0, top.share)
			for _, e := range s.ends(f) {
				if e >= 0 {
					ls[e].cap -= f.rate
					ls[e].left--
				}
			}
		}
	}
	s.heap, s.links = h, ls
}

// grown is ls one link longer, with no flows, reusing the flows slice of
// the link an earlier step had there.
func grown(ls []link) []link {
	if len(ls) < cap(ls) {
		ls = ls[:len(ls)+1]
	} else {
		ls = append(ls, link{})
	}
	l := &ls[len(ls)-1]
	l.flows, l.left = l.flows[:0], 0
	return ls
}

// relaying reports whether f is a relay: its sender is still receiving
// the chunk.
func (f *flow) relaying() bool {
	return f.upstream != nil && !bitSet(f.from.have, f.req.Chunk)
}

// relayPace is the most relay f can send in this step, in bytes a second:
// what its sender has of the chunk beyond f, and the pace the chunk comes
// to the sender at.
func (s *sim) relayPace(f *flow) float64 {
	u := f.upstream
	ahead := math.Max(0, u.got-p2p.PlanRelayPiece-f.got)
	rate := 0.0
	if !u.done && !u.frozen {
		rate = math.Max(0, u.rate)
	}
	return ahead/s.step.Seconds() + rate
}

// ends are the indexes in s.links of f's uplink, downlink and pace (-1:
// none).
func (s *sim) ends(f *flow) [3]int {
	up := 2 * len(s.nodes)
	if f.from != nil {
		up = 2 * f.from.idx
	}
	return [3]int{up, 2*f.to.idx + 1, f.paceLink}
}

type link struct {
	cap   float64
	left  int // flows not fixed yet
	flows []*flow
}

type linkShare struct {
	share float64
	link  int
}

type linkHeap []linkShare

func (h linkHeap) Len() int           { return len(h) }
func (h linkHeap) Less(i, j int) bool { return h[i].share < h[j].share }
func (h linkHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *linkHeap) Push(x any)        { *h = append(*h, x.(linkShare)) }
func (h *linkHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

func (s *sim) result(limit float64) (Result, error) {
	r := Result{Nodes: len(s.nodes), LimitS: limit, Refresh: s.cfg.Swarm.Refresh, Step: s.cfg.Step, SimulatedS: s.now.Seconds()}
	var ratios, slow, fast []float64
	var relayed, cpu, stateBytes, stateReads, refused, fillS float64
	for _, n := range s.nodes {
		relayed += float64(n.relayed)
		cpu += n.cpu.Seconds()
		if n.ban {
			r.BannedLiar++
		}
		for _, h := range s.nodes {
			if !n.dead && !h.dead && !h.liar && n.swarm.Banned(h.name) {
				r.BannedHonest++
			}
		}
		if n.fromOrigin >= float64(s.cfg.Size)/10 {
			r.Fetchers++
			if n.up < s.cfg.Link {
				r.SlowFetchers++
			}
			if n.dead {
				r.KilledFetchers++
			}
			if n.liar {
				r.LyingFetchers++
			}
		}
		if n.dead {
			r.Killed++
			continue
		}
		if n.seed {
			r.Seeders++
			r.SeedRatio += float64(n.relayed) / float64(s.cfg.Size) / float64(s.cfg.Seeders)
			continue
		}
		if n.done == 0 || (s.cfg.StreamRate > 0 && n.readDone == 0) {
			continue
		}
		r.Finished++
		took := n.done
		if s.cfg.StreamRate > 0 {
			took = n.readDone
		}
		ratio := took.Seconds() / limit * math.Min(n.up, n.down) / s.cfg.Link
		ratios = append(ratios, ratio)
		if n.up < s.cfg.Link {
			slow = append(slow, ratio)
		} else {
			fast = append(fast, ratio)
		}
		stateBytes += float64(n.stateBytes)
		stateReads += float64(n.stateReads)
		refused += float64(n.refused)
		fillS += n.done.Seconds()
	}
	if r.Finished+r.Killed+r.Seeders != r.Nodes {
		return r, fmt.Errorf("swarmsim: %d of %d nodes finished (%d killed) in %.0f s", r.Finished, r.Nodes, r.Killed, r.SimulatedS)
	}
	slices.Sort(ratios)
	r.TimeRatioP50 = quantile(ratios, 0.5)
	r.TimeRatioP99 = quantile(ratios, 0.99)
	r.TimeRatioMax = ratios[len(ratios)-1]
	if len(slow) > 0 {
		slices.Sort(slow)
		r.SlowTimeRatioP50 = quantile(slow, 0.5)
	}
	if len(fast) > 0 {
		slices.Sort(fast)
		r.FastTimeRatioP99 = quantile(fast, 0.99)
	}
	r.OriginRatio = s.origin / float64(s.cfg.Size)
	r.OriginDoneRatio = s.originLast.Seconds() / limit
	r.RelayedBytesPerNode = relayed / float64(r.Nodes)
	r.SchedCPUPerNode = cpu / float64(r.Nodes)
	r.StateBytesPerNodeS = stateBytes / fillS
	r.RefusedPerNodeS = refused / fillS
	r.StateReadsPerNodeS = stateReads / fillS
	r.GossipBytesPerNodeS = gossipBytes(r.Nodes, s.events, r.SimulatedS)
	if s.cfg.Zones > 1 {
		for _, b := range s.zoneIn {
			r.ZoneInRatio = max(r.ZoneInRatio, b/float64(s.cfg.Size))
		}
	}
	return r, nil
}

// quantile is the q-quantile of sorted xs, nearest rank.
func quantile(xs []float64, q float64) float64 {
	return xs[max(0, int(math.Ceil(q*float64(len(xs))))-1)]
}

// threadCPU is the CPU time of the calling OS thread.
func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		panic(err) // Linux has had it since 2.6.12
	}
	return time.Duration(ts.Nano())
}

func bitSet(b []byte, i int) bool { return b[i/8]&(1<<(i%8)) != 0 }

func setBit(b []byte, i int) []byte { b[i/8] |= 1 << (i % 8); return b }

func clearBit(b []byte, i int) []byte { b[i/8] &^= 1 << (i % 8); return b }
