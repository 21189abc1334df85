package p2p

import (
	"cmp"
	"slices"
	"time"

	"github.com/opencontainers/go-digest"
)

// Zones: traffic between zones costs money and crosses the narrowest
// links, so each chunk should enter a zone once and spread inside it.
// Every name without a zone is in the zone "": with no --zone anywhere,
// all nodes are in one zone and nothing here changes a decision.

// zoneOrder is the origin election's order of names for d: rendezvous
// order, but each zone's first node before any zone's second, and so on,
// so the OriginFetchers first nodes lie in as many zones as they can. All
// nodes compute the same order from the same names and zones; in one zone
// it is the rendezvous order.
func zoneOrder(d digest.Digest, names []string, zoneOf func(string) string) []string {
	order := rendezvous(d, names)
	round := make(map[string]int, len(order)) // a name's place within its zone
	placed := map[string]int{}
	for _, n := range order {
		z := zoneOf(n)
		round[n] = placed[z]
		placed[z]++
	}
	slices.SortStableFunc(order, func(a, b string) int { return cmp.Compare(round[a], round[b]) })
	return order
}

// electionOrder is zoneOrder with the zones this fill knows.
func (f *plan) electionOrder(names []string) []string {
	return zoneOrder(f.d, names, f.zoneOf)
}

// zoneOf is the zone of a node: this one's, a followed peer's, or a
// member's as gossip has it ("" when none is known).
func (f *plan) zoneOf(name string) string {
	if name == f.s.dir.LocalName() {
		return f.s.cfg.Zone
	}
	if pv := f.peers.get(name); pv != nil {
		return pv.zone
	}
	p, _ := f.s.dir.Peer(name)
	return p.Meta.Zone
}

// nearer reports whether supplier a beats b for chunk i: a peer in this
// node's zone beats one outside it; then one whose upload is not the
// origin fetcher's repeat of a chunk it sent (see supplierOf); then, but
// for the endgame, one still filling the blob beats one holding it whole,
// whose upload is left to the chunks no other has; then supplyRank, then
// the less loaded.
func (f *plan) nearer(a, b *peerView, i int, endgame bool) bool {
	key := func(pv *peerView) [4]int {
		far, repeat, whole := 0, 0, 0
		if pv.zone != f.s.cfg.Zone {
			far = 1
		}
		if pv.state.Origin && !endgame && pv.state.WasSent(i) {
			repeat = 1
		}
		if pv.state.Complete && !endgame {
			whole = 1
		}
		return [4]int{far, repeat, whole, supplyRank(pv, i)}
	}
	ka, kb := key(a), key(b)
	if c := slices.Compare(ka[:], kb[:]); c != 0 {
		return c < 0
	}
	return f.s.inflightTo(a.name) < f.s.inflightTo(b.name)
}

// zoneView is what one fill keeps for its zone decisions.
type zoneView struct {
	crossSince map[int]time.Time // when a chunk was first seen outside the zone only
	entries    []string          // the zone's nodes filling the blob, in rendezvous order
	entriesAt  time.Time
}

// mayCrossZone reports whether this node may fetch chunk i from outside
// its zone, inZone telling whether a peer of its zone has or receives it:
// never then (that copy is near, also for an endgame duplicate: every node
// of the zone would send one across), else for the endgame, the zone's
// entry for the chunk, or anyone once the chunk has waited two holdoffs
// for an entry that, seeing other holders than this node does, may not
// know it is one.
func (f *plan) mayCrossZone(i int, inZone, endgame bool, now time.Time) bool {
	if inZone {
		return false
	}
	if endgame {
		return true
	}
	if f.zoneEntry(i, now) == f.s.dir.LocalName() {
		return true
	}
	if f.zone.crossSince == nil {
		f.zone.crossSince = map[int]time.Time{}
	}
	since, ok := f.zone.crossSince[i]
	if !ok {
		f.zone.crossSince[i] = now
		return false
	}
	return now.Sub(since) >= 2*f.holdoff()
}

// zoneEntry is the node of this zone that fetches chunk i from outside
// it: the chunks are dealt round the zone's nodes that still fill the
// blob, in rendezvous order, so each crosses into the zone once and the
// zone's downlinks share the crossing. The deal is redone at most twice
// per Refresh, when the states it rests on may have changed.
func (f *plan) zoneEntry(i int, now time.Time) string {
	if f.zone.entries == nil || now.Sub(f.zone.entriesAt) >= f.s.cfg.Refresh/2 {
		names := []string{f.s.dir.LocalName()}
		for _, pv := range f.peers.all() {
			name := pv.name
			if pv.known && !pv.state.Complete && pv.zone == f.s.cfg.Zone && !f.s.Banned(name) {
				names = append(names, name)
			}
		}
		f.zone.entries, f.zone.entriesAt = rendezvous(f.d, names), now
	}
	return f.zone.entries[i%len(f.zone.entries)]
}
