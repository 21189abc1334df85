package p2p

import (
	"slices"
	"sync/atomic"
	"time"
)

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

// pickWanted returns the lowest missing chunk from the byte a reader waits
// on (Want), within maxInFlight chunks of it, that is asked of no one and
// that a free peer can supply; -1 if none. A reader's next bytes beat
// rarity: the registry mirror streams a blob to containerd in order, and
// a pull's progress is its prefix.
func (f *plan) pickWanted(missing []int, chunkSize int64) (int, *peerView) {
	if f.want == nil || f.want.Load() < 0 {
		return -1, nil
	}
	first := int(f.want.Load() / chunkSize)
	best := -1
	var bestPeer *peerView
	now := f.s.cfg.Now()
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

// pickFromPeers returns the rarest missing chunk not in flight (or, for
// endgame, in flight once) that a usable peer has or is receiving, and the
// best such peer (supplyRank, then the least loaded); -1 if none. Of
// chunks equally rare, a blob a reader streams takes the first: those only
// one node holds whole then come from it about in order, and the reader's
// prefix follows the fill rather than waiting for its end. No endgame
// while the node fills other blobs too: its downlink carries their chunks,
// and a duplicate would take its bytes from them.
func (f *plan) pickFromPeers(missing []int, endgame bool) (int, *peerView) {
	if endgame {
		if f.s.severalFills() {
			return -1, nil
		}
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
	now := f.s.cfg.Now()
	inOrder := f.want != nil && f.want.Load() >= 0
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
		if pick.zone != f.s.cfg.Zone {
			// This node brings the chunk into its zone (mayCrossZone),
			// whose other nodes wait for it: before any other.
			score -= 2 * (f.peers.len() + 1)
		}
		if best < 0 || score < bestScore || (inOrder && score == bestScore && i < best) {
			best, bestScore, bestPeer = i, score, pick
		}
	}
	return best, bestPeer
}

// supplierOf returns the best usable peer to ask for chunk i (nearer; nil
// if none is free) and how many known peers have or are receiving it.
//
// An origin fetcher's upload is the swarm's narrowest pipe: every chunk of
// its share must leave it once, as fast as it comes from the origin. It is
// asked again for a chunk it already sent (but for the last chunks) only
// when no other holder of its zone is free; it sends one such repeat at a
// time, when its upload has room, and refuses the others. A peer outside
// this node's zone is asked only as mayCrossZone allows.
func (f *plan) supplierOf(i int, endgame bool, now time.Time) (pick *peerView, count int) {
	inZone, zoneHas := false, false
	for pv := range f.peers.from(f.s.rand) {
		if !pv.known || (!pv.state.Has(i) && !pv.state.IsFetching(i)) {
			continue
		}
		count++
		if f.s.Banned(pv.name) {
			continue
		}
		if pv.zone == f.s.cfg.Zone {
			inZone = true
			zoneHas = zoneHas || pv.state.Has(i)
		}
		if f.s.inflightTo(pv.name) >= f.s.cfg.PerPeer || now.Before(pv.busyTill) || now.Before(pv.chunkBusy[i]) ||
			(endgame && slices.Contains(f.asked[i], pv.name)) {
			continue
		}
		if pick == nil || f.nearer(pv, pick, i, endgame) {
			pick = pv
		}
	}
	if pick != nil && pick.zone != f.s.cfg.Zone && !f.mayCrossZone(i, inZone, zoneHas, endgame, now) {
		return nil, count
	}
	return pick, count
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

// holdoff is how long to wait for a chunk to come from the peer its only
// holder sent it to: about one chunk's transfer time.
func (f *plan) holdoff() time.Duration {
	if f.chunkTime == 0 {
		return 500 * time.Millisecond
	}
	return min(f.chunkTime*3/2, maxHoldoff)
}

// maxHoldoff bounds holdoff.
const maxHoldoff = 5 * time.Second
