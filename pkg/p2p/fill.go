package p2p

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// peerView is what one download knows of one holder.
type peerView struct {
	name      string
	addr      string
	zone      string // its zone, as gossip has it
	state     PeerState
	known     bool      // state has been read at least once
	lastAlive time.Time // last time membership listed it alive
	reading   bool      // a state request is in flight
	readAt    time.Time
	heardAt   time.Time // when the last read answered (with a state or an error) was sent
	silent    bool      // the last read answered with an error, not a state
	inflight  int
	failures  int
	busyTill  time.Time
	chunkBusy map[int]time.Time // chunks it is sending to someone else now
	sentSeen  map[int]time.Time // when we first saw it had sent a chunk we miss
	// An origin fetcher's pace, as its states show it (fetcherPace): how
	// many chunks it held when that count last grew, and the time between
	// chunks coming to it (moving average).
	held       int
	heldAt     time.Time
	chunkEvery time.Duration
	// Chunks this origin fetcher sent once to a receiver that proved no
	// source (banned here, or gone): the next request asks it again.
	sendAgain map[int]bool
}

type chunkResult struct {
	chunk int
	peer  string // "" for the origin
	relay bool   // asked of a peer that was still receiving it
	again bool   // asked an origin fetcher to send it again
	err   error
	bytes int64
	took  time.Duration
}

type stateResult struct {
	peer  string
	state PeerState
	err   error
}

// plan is one blob's swarm decisions: what it knows of each holder, the
// requests in flight, the origin role, on the swarm's clock. It does no
// I/O: a fill carries out its requests and state reads, and a simulation
// (Planner) can drive the same decisions over a simulated network.
type plan struct {
	s         *Swarm
	d         digest.Digest
	desc      content.Descriptor
	chunkSize int64
	chunks    int
	start     time.Time

	want           *atomic.Int64 // the byte a reader waits on (-1 none): its chunks go first
	maxInFlight    int           // requests in flight, bounded by the chunk buffers they need
	buffered       int64         // bytes of chunk buffers booked for the requests in flight (Swarm.bufferRoom)
	peers          peerSet
	absent         map[string]time.Time // members that had none of the blob when asked, and when
	probedAt       time.Time            // when the first-ranked members were last looked for
	inflight       map[int]int          // chunk → requests in flight
	asked          map[int][]string     // chunk → the peers it is in flight from (endgame duplicates go elsewhere)
	givenUp        map[int]int          // chunk → its copies given up as too slow (mayGiveUp)
	leftSince      map[int]time.Time    // chunk → when this origin fetcher, its share done, first left it to another's share (unfetched)
	originRole     bool
	originSince    time.Time // when this node took the origin role
	originAtOnce   bool      // it took the role without waiting: alone, or among the first of all members
	originShown    bool      // peers see it fetch from the origin (Swarm.setOrigin): at once, or once its rivals are heard
	rivals         []string  // the followed peers ranked above it when it took the role at its turn, not heard from since
	originInflight int
	originFailures int       // origin requests failed in a row without an answer
	originHeard    time.Time // when the origin last sent bytes (or the download began)
	originPause    time.Time
	released       bool          // release ran: the fill no longer counts (Swarm.fills)
	chunkTime      time.Duration // recent time to fetch one chunk (moving average)
	originTime     time.Duration // recent time to fetch one chunk from the origin (moving average)
	zone           zoneView

	leading     []string  // the first holders in election order (follow)
	settledOn   []string  // the origin fetchers seen, once the role is settled for this node (settled)
	fetcherDraw float64   // whether it keeps following them (dropsFetchers)
	holders     []string  // the holders gossip named at the last follow, the complete ones first
	completes   int       // how many of holders are complete
	followedAt  time.Time // when holders were last looked at
	leadersAt   time.Time
	rotatedAt   time.Time
}

// newPlan starts the decisions for a blob of desc in chunks of chunkSize.
func (s *Swarm) newPlan(desc content.Descriptor, chunkSize int64, want *atomic.Int64) *plan {
	now := s.cfg.Now()
	s.fills.Add(1)
	return &plan{s: s, d: desc.Digest, desc: desc, chunkSize: chunkSize, chunks: chunksOf(desc.Size, chunkSize),
		start: now, originHeard: now, want: want,
		maxInFlight: max(2, min(s.cfg.MaxInFlight, int(maxInFlightBytes/chunkSize))),
		absent:      map[string]time.Time{}, inflight: map[int]int{}, asked: map[int][]string{}}
}

// request is one of plan's decisions: ask peer for chunk, or the origin
// when peer is nil.
type request struct {
	chunk    int
	peer     *peerView
	slowEnds bool // give the copy up if it comes too slowly (CopyTooSlow)
	again    bool // ask an origin fetcher to send it again (peerView.sendAgain)
}

// fill is one blob's download through the swarm: its plan's requests and
// state reads, carried out by goroutines that report to its loop.
type fill struct {
	*plan
	p      *cache.Partial
	origin Origin

	supplierMu  sync.Mutex
	supplier    map[int]string // chunk → the peer it came from ("" origin); written by request goroutines
	wg          sync.WaitGroup
	results     chan chunkResult
	states      chan stateResult
	hashQueries chan hashQuery
	hashWaits   []hashQuery // queries not answered yet
}

func (f *fill) run(parent context.Context) error {
	// Requests run under ctx; the final check and repair under parent, after
	// the endgame duplicates have been cancelled.
	ctx, cancel := context.WithCancel(parent)
	defer func() {
		cancel()
		f.wg.Wait()
		f.release()
		f.s.seeFetchers(f.origin.Name, f.d, nil)
	}()
	every := f.refreshEvery()
	tick := time.NewTicker(every / 2)
	defer tick.Stop()
	for {
		if e := f.refreshEvery(); e != every {
			every = e
			tick.Reset(every / 2)
		}
		missing := f.p.Missing()
		if len(missing) == 0 {
			cancel() // endgame duplicates still running
			f.wg.Wait()
			return f.verify(parent)
		}
		f.readStates(ctx, f.refresh(missing))
		f.decideOrigin()
		f.paceOrigin()
		f.answerHashes()
		f.launch(ctx, f.schedule(missing))
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

// refreshEvery is this fill's Refresh: the least time between two reads
// of one holder's state, and a refused or busy peer's backoff. On a fast
// link, where a chunk comes in a few Refreshes, each relay hop's wait for
// news would weigh on the fill: there it is an eighth of a chunk's time
// here, down to a tenth of SwarmConfig.Refresh. Until a chunk has come,
// and where chunks take longer (most links under a few Gbit/s), Refresh.
func (f *plan) refreshEvery() time.Duration {
	if f.chunkTime == 0 {
		return f.s.cfg.Refresh
	}
	return max(min(f.chunkTime/8, f.s.cfg.Refresh), f.s.cfg.Refresh/10)
}

// peerGrace is how long a holder that membership no longer lists is kept:
// under load, failure detection flaps, and a peer that answers is still
// worth asking (one that does not is soon banned).
const peerGrace = 10 * time.Second

// refresh learns new holders from gossip (follow) and returns the
// holders whose chunk states to read again now; each read waits at the
// holder until it has news.
func (f *plan) refresh(missing []int) []*peerView {
	now := f.s.cfg.Now()
	f.follow(now, missing)
	// Gossip can miss a holder (it is UDP, and packets drop while links
	// are full), and the origin role hinges on the nodes ranked first for
	// the blob: until it is settled, ask those directly whether they hold
	// it. Not more often than addPeer asks an absent member again:
	// ranking the members costs a hash each.
	if f.settledOn == nil && now.Sub(f.probedAt) >= f.rankEvery(now) {
		f.probedAt = now
		names := f.withMembers(f.s.dir.Members())
		for _, name := range f.electionOrder(names)[:min(len(names), f.leaders())] {
			f.addPeer(name, now)
		}
	}
	var reads []*peerView
	for _, pv := range f.peers.all() {
		name := pv.name
		if _, alive := f.s.dir.Peer(name); alive {
			pv.lastAlive = now
		} else if now.Sub(pv.lastAlive) > peerGrace && pv.inflight == 0 && !pv.reading {
			f.peers.remove(name) // left the cluster
			continue
		}
		if pv.reading || f.s.Banned(name) || (pv.known && pv.state.Complete) || now.Sub(pv.readAt) < f.refreshEvery() {
			continue
		}
		pv.reading, pv.readAt = true, now
		reads = append(reads, pv)
	}
	return reads
}

// readStates reads the chunk states of peers, each on its own goroutine.
func (f *fill) readStates(ctx context.Context, peers []*peerView) {
	for _, pv := range peers {
		known := pv.state
		if !pv.known {
			known.Have = nil
		}
		f.wg.Add(1)
		go func(name, addr string, isKnown bool) {
			defer f.wg.Done()
			st, err := f.s.readState(ctx, addr, f.d, f.chunks, isKnown, known)
			select {
			case f.states <- stateResult{peer: name, state: st, err: err}:
			case <-ctx.Done():
			}
		}(pv.name, pv.addr, pv.known)
	}
}

// absentFor is how long a member that had none of the blob when asked is
// not asked again (gossip says when it starts to hold it). While the origin
// role is being settled it is asked four times per Settle, so that nodes
// asked for the blob at about the same time all count each other.
const absentFor = 5 * time.Second

// rankEvery is how often the nodes first in election order are looked
// for: as often as addPeer asks an absent member again.
func (f *plan) rankEvery(now time.Time) time.Duration {
	if now.Sub(f.start) < 2*f.s.cfg.Settle {
		return f.s.cfg.Settle / 4
	}
	return absentFor
}

// addPeer starts to follow peer's state of the blob, unless it is this
// node, already followed, unknown or recently found absent.
func (f *plan) addPeer(name string, now time.Time) {
	if name == f.s.dir.LocalName() || f.peers.get(name) != nil || now.Sub(f.absent[name]) < f.rankEvery(now) {
		return
	}
	peer, ok := f.s.dir.Peer(name)
	if !ok || peer.Meta.ChunkAddr == "" {
		return
	}
	f.peers.add(&peerView{name: name, addr: peer.Meta.ChunkAddr, zone: peer.Meta.Zone, lastAlive: now,
		chunkBusy: map[int]time.Time{}, sentSeen: map[int]time.Time{}})
}

// meetReceiver follows name, which an origin fetcher says it sent a chunk
// to, unless it does already: a fetcher sends each chunk once, and only
// the receiver's followers would see it there (a fill follows MaxFollowed
// holders); the others waited for a repeat, at 10 Gbit/s the whole
// fill's tail (docs/swarm-tuning.md). A new peer's state is read at the
// next pass. It reports false where the receiver is no source: banned
// here, not a member, or this node.
func (f *plan) meetReceiver(name string) bool {
	if name == f.s.dir.LocalName() || f.s.Banned(name) {
		return false
	}
	if _, ok := f.s.dir.Peer(name); !ok {
		return false
	}
	delete(f.absent, name)
	f.addPeer(name, f.s.cfg.Now())
	return true
}

func (f *plan) updateState(r stateResult) {
	pv := f.peers.get(r.peer)
	if pv == nil {
		return
	}
	pv.reading, pv.heardAt, pv.silent = false, pv.readAt, r.err != nil
	if errors.Is(r.err, errNotHeld) && pv.inflight == 0 {
		f.peers.remove(r.peer)
		f.absent[r.peer] = f.s.cfg.Now()
		return
	}
	if errors.Is(r.err, errStateTooBig) {
		f.s.log.Warn("peer's chunk state is too big for the blob", "peer", r.peer, "digest", f.d, "err", r.err)
		f.s.ban(r.peer, "bad_state")
		return
	}
	if r.err != nil {
		f.s.log.Debug("reading peer chunk state", "peer", r.peer, "digest", f.d, "err", r.err)
		// A peer that does not answer sends nothing: its claims to fetch
		// the blob, its origin share or chunks on their way to it, hold
		// back no chunk. One killed mid-transfer stays a member for
		// seconds, and is kept for peerGrace after that.
		pv.state.Origin, pv.state.Fetching = false, nil
		return
	}
	if r.state.Size != f.desc.Size || r.state.ChunkSize != f.chunkSize {
		f.s.log.Warn("peer's chunk state does not fit the blob", "peer", r.peer, "digest", f.d,
			"size", r.state.Size, "chunkSize", r.state.ChunkSize)
		f.s.ban(r.peer, "bad_state")
		return
	}
	pv.state, pv.known = r.state, true
	now := f.s.cfg.Now()
	for i := range f.chunks {
		if _, seen := pv.sentSeen[i]; !seen && pv.state.WasSent(i) {
			pv.sentSeen[i] = now
		}
	}
	if pv.state.Origin && f.originRole { // only an origin fetcher helps others
		_, fetchers := f.originShare()
		if share := slices.Index(fetchers, pv.name); share >= 0 {
			held := 0
			for i := share; i < f.chunks; i += len(fetchers) {
				if pv.state.Has(i) {
					held++
				}
			}
			fetcherPace(pv, held, now)
		}
	}
}

// fetcherPace times origin fetcher pv by the chunks of its origin share
// it came to hold between its states (held, in all). Its states come every
// Refresh or so, far less often on a loaded node, and a chunk can come and
// go between two: the time from a chunk seen on its way to seen held is
// the reads' pace, not the fetcher's.
func fetcherPace(pv *peerView, held int, now time.Time) {
	came := held - pv.held
	if came <= 0 {
		pv.held = held
		return
	}
	if !pv.heldAt.IsZero() {
		every := now.Sub(pv.heldAt) / time.Duration(came)
		if pv.chunkEvery > 0 {
			every = (3*pv.chunkEvery + every) / 4
		}
		pv.chunkEvery = every
	}
	pv.held, pv.heldAt = held, now
}

// originPace folds an origin request's time into avg, a moving average in
// which one request counts for at most four times avg: a process stalled
// by its CPU quota times one request at a hundred times the others, and
// helping origin fetchers (leaveTo) then took the chunks a fetcher far
// faster than that was about to ask for.
func originPace(avg, took time.Duration) time.Duration {
	if avg > 0 {
		took = min(took, 4*avg)
	}
	return (3*avg + took) / 4
}

// schedule decides requests until the limits are reached, and books each
// as in flight: as an origin fetcher, the first chunk of its share nobody
// has, from the origin; else the next chunk a reader waits on, or the
// rarest chunk, that a peer with a free slot has; else endgame duplicates.
func (f *plan) schedule(missing []int) []request {
	var reqs []request
	total := f.inflightTotal()
	f.s.rand.Shuffle(len(missing), func(i, j int) { missing[i], missing[j] = missing[j], missing[i] })
	// Two requests always: a download never waits on others' buffers.
	for total < f.maxInFlight && (total < 2 || f.s.bufferRoom(f.chunkSize)) {
		// The origin first: its fetchers are the swarm's only way in, and
		// every node waits on what they bring.
		if f.useOrigin() {
			if chunk := f.nextFromOrigin(missing); chunk >= 0 {
				reqs = append(reqs, f.book(chunk, nil))
				total++
				continue
			}
		}
		if !f.mayAskPeers(total, missing) {
			break
		}
		chunk, peer := f.pickWanted(missing, f.chunkSize)
		if chunk < 0 {
			chunk, peer = f.pickFromPeers(missing, false)
		}
		if chunk < 0 {
			chunk, peer = f.pickFromPeers(missing, true)
		}
		if chunk < 0 {
			break
		}
		reqs = append(reqs, f.book(chunk, peer))
		total++
	}
	return reqs
}

// book counts a request for chunk i to pv (nil: the origin) in flight.
// Whoever carries it out gives back the count of this node's requests to
// pv (requestCounter) once the transfer ends, and hands the result to
// handle.
func (f *plan) book(i int, pv *peerView) request {
	f.inflight[i]++
	f.buffered += f.chunkSize
	f.s.buffered.Add(f.chunkSize)
	if pv == nil {
		f.originInflight++
		return request{chunk: i}
	}
	pv.inflight++
	f.asked[i] = append(f.asked[i], pv.name)
	f.s.requestCounter(pv.name).Add(1)
	again := pv.sendAgain[i]
	delete(pv.sendAgain, i)
	return request{chunk: i, peer: pv, slowEnds: f.mayGiveUp(i, pv), again: again}
}

// mayGiveUp reports whether a copy of chunk i from pv that comes too
// slowly is given up (CopyTooSlow): not an origin fetcher's, which the
// origin paces, and only maxGiveUps times per chunk. The copies asked for
// after them are waited for however slowly they come, so that a chunk
// whose every source is slow (one slow holder of a blob, no origin
// fetcher) still comes. None while the node fills other blobs too: its
// downlink is shared among all their copies, slow copies are the norm,
// and one given up throws its bytes away to fetch them again over the
// same full link (docs/swarm-tuning.md).
func (f *plan) mayGiveUp(i int, pv *peerView) bool {
	return !pv.state.Origin && f.givenUp[i] < maxGiveUps && !f.s.severalFills()
}

// maxGiveUps is how many copies of one chunk may be given up as too slow.
const maxGiveUps = 2

// unask takes one request for chunk i to peer off asked.
func (f *plan) unask(i int, peer string) {
	peers := f.asked[i]
	if k := slices.Index(peers, peer); k >= 0 {
		peers = slices.Delete(peers, k, k+1)
	}
	if len(peers) == 0 {
		delete(f.asked, i)
		return
	}
	f.asked[i] = peers
}

// inflightTotal is the requests in flight, to peers and the origin.
func (f *plan) inflightTotal() int {
	total := f.originInflight
	for _, pv := range f.peers.all() {
		total += pv.inflight
	}
	return total
}

// launch starts the requests schedule decided.
func (f *fill) launch(ctx context.Context, reqs []request) {
	for _, r := range reqs {
		if r.peer == nil {
			f.launchOrigin(ctx, r.chunk)
		} else {
			f.launchPeer(ctx, r)
		}
	}
}

// launchPeer asks r's peer for its chunk. A peer that is still receiving
// the chunk relays it as it comes, and gives its hash after the last byte:
// which hash the chunk must have is settled then (askHash). With
// slowEnds, a copy that comes too slowly is given up (CopyTooSlow).
func (f *fill) launchPeer(ctx context.Context, r request) {
	i, pv := r.chunk, r.peer
	relay := !pv.state.Has(i)
	var want []byte
	if !relay {
		want = f.trustedHash(i, pv.name, pv.state.Hash(i))
	}
	n := f.p.ChunkLen(i)
	timeout := f.s.requestTimeout(n, relay)
	toPeer := f.s.requestCounter(pv.name)
	f.wg.Add(1)
	go func(name, addr string) {
		defer f.wg.Done()
		start := f.s.cfg.Now()
		c := f.s.live.chunk(f.d, i, n)
		claim, err := f.s.fetchChunk(ctx, addr, f.d, i, timeout, r.slowEnds, r.again, c)
		if err == nil && want == nil {
			want, err = f.askHash(ctx, i, name, claim)
		}
		if err == nil {
			err = f.write(i, c.data(), want, name)
		}
		f.settle(i, c, err)
		toPeer.Add(-1)
		f.report(ctx, chunkResult{chunk: i, peer: name, relay: relay, again: r.again, err: err, bytes: n, took: f.s.cfg.Now().Sub(start)})
	}(pv.name, pv.addr)
}

func (f *fill) launchOrigin(ctx context.Context, i int) {
	n := f.p.ChunkLen(i)
	off := int64(i) * f.chunkSize
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		start := f.s.cfg.Now()
		c := f.s.live.chunk(f.d, i, n)
		err := f.s.fetchOrigin(ctx, f.origin, off, c)
		if err == nil {
			err = f.write(i, c.data(), nil, "")
		}
		f.settle(i, c, err)
		f.report(ctx, chunkResult{chunk: i, err: err, bytes: n, took: f.s.cfg.Now().Sub(start)})
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
func (f *plan) handle(r chunkResult) error {
	f.inflight[r.chunk]--
	f.buffered -= f.chunkSize
	f.s.buffered.Add(-f.chunkSize)
	source := sourceOf(r.peer)
	if r.peer == "" {
		f.originInflight--
	} else {
		f.unask(r.chunk, r.peer)
		if pv := f.peers.get(r.peer); pv != nil {
			pv.inflight--
		}
	}
	if r.err == nil {
		f.s.m.latency.WithLabelValues(source).Observe(r.took.Seconds())
		if f.chunkTime == 0 {
			f.chunkTime = r.took
		} else {
			f.chunkTime = (3*f.chunkTime + r.took) / 4
		}
		f.s.log.Debug("chunk fetched", "digest", f.d, "chunk", r.chunk, "from", cmp.Or(r.peer, "origin"), "took", r.took, "inflight", f.inflightTotal())
		if pv := f.peers.get(r.peer); pv != nil {
			pv.failures = 0
			if pv.zone != f.s.cfg.Zone {
				f.s.m.crossZone.Add(float64(r.bytes))
			}
		}
		if r.peer == "" {
			f.originFailures, f.originHeard = 0, f.s.cfg.Now()
			f.originTime = originPace(f.originTime, r.took)
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
	pv := f.peers.get(r.peer)
	switch {
	case errors.Is(r.err, errChunkBusy):
		if pv == nil {
			break
		}
		// A refused request to send again (sent again as often as the
		// fetcher will): wait a Refresh, not a round trip.
		var to *sentToError
		if !r.again && errors.As(r.err, &to) && !f.meetReceiver(to.peer) {
			// Its receiver is no source for this node: ask again at once.
			if pv.sendAgain == nil {
				pv.sendAgain = map[int]bool{}
			}
			pv.sendAgain[r.chunk] = true
			break
		}
		pv.chunkBusy[r.chunk] = f.s.cfg.Now().Add(f.refreshEvery())
	case errors.Is(r.err, errBusy):
		if pv != nil {
			pv.busyTill = f.s.cfg.Now().Add(f.refreshEvery())
		}
	case errors.Is(r.err, errSlow):
		// Its upload is shared by many requesters: ask it less for a
		// while, but a popular peer (the origin fetcher above all) is
		// not banned for being popular.
		f.s.log.Debug("peer too slow for a chunk", "peer", r.peer, "digest", f.d, "chunk", r.chunk, "err", r.err)
		if f.givenUp == nil {
			f.givenUp = map[int]int{}
		}
		f.givenUp[r.chunk]++
		if pv != nil {
			pv.busyTill = f.s.cfg.Now().Add(slowBackoff)
		}
	case errors.Is(r.err, content.ErrDigestMismatch):
		f.s.m.mismatches.Inc()
		f.s.ban(r.peer, "corrupt_chunk")
	case errors.Is(r.err, errRelayCut) || errors.Is(r.err, errNoHash) || (r.relay && errors.Is(r.err, errNotHeld)):
		// The chunk failed on its way to the relay (or before it was
		// asked), or came whole and its hash did not: not the relay's
		// fault. Ask again after the next word of its state.
		f.s.log.Debug("relayed chunk failed", "peer", r.peer, "digest", f.d, "chunk", r.chunk, "err", r.err)
		if pv != nil {
			pv.chunkBusy[r.chunk] = f.s.cfg.Now().Add(f.refreshEvery())
			pv.readAt = time.Time{}
		}
	default:
		f.s.log.Debug("peer chunk failed", "peer", r.peer, "digest", f.d, "chunk", r.chunk, "err", r.err)
		if pv != nil {
			pv.failures++
			pv.busyTill = f.s.cfg.Now().Add(2 * f.refreshEvery())
			pv.readAt = time.Time{} // re-read its state before asking again
			if pv.failures >= 3 {
				f.s.ban(r.peer, "failing")
			}
		}
	}
	return nil
}

// slowBackoff is how long a peer that sent a chunk too slowly is not asked
// for another.
const slowBackoff = 2 * time.Second
