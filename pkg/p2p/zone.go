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
	crossSince map[int]time.Time // when a chunk was last seen outside the zone only
	names      []string          // the zone's nodes that fill the blob, this one first
	hashes     []uint64          // the names' hashes with the blob, for zoneRank
	ranks      map[int]int       // chunk → this node's rank for it among names
	namesAt    time.Time
}

// zoneSpares is how many of a chunk's first nodes in its zone's order may
// fetch it from outside the zone past a zone copy that is slow: one they
// gave up, or one only on its way for long (mayCrossZone).
const zoneSpares = 3

// mayCrossZone reports whether this node may fetch chunk i from outside
// its zone: inZone tells whether a peer of its zone has or receives it,
// zoneHas whether one has it. Each chunk crosses into a zone through one
// node, its entry (zoneRank 0), and spreads inside it:
//   - while a zone peer has or receives the chunk, that copy is near, and
//     no node crosses, also for an endgame duplicate (every node of the
//     zone would send one across); but a zone whose only copy comes from a
//     slow or failing node would wait on it, so a chunk's first zoneSpares
//     nodes may cross when they gave up copies of it as too slow, or when
//     the zone's copy has only been on its way for 2×(rank+1) holdoffs;
//   - the last chunks cross at once, and the entry;
//   - the others cross once the chunk has been outside the zone only for
//     a holdoff per node ranked above them: the entry may be gone, or see
//     other nodes of the zone than they do, and the next one crosses
//     before a crowd does.
func (f *plan) mayCrossZone(i int, inZone, zoneHas, endgame bool, now time.Time) bool {
	if f.zone.crossSince == nil {
		f.zone.crossSince = map[int]time.Time{}
	}
	rank := f.zoneRank(i, now)
	coming := inZone && !zoneHas && rank < zoneSpares
	if inZone && !coming && (f.givenUp[i] == 0 || rank >= zoneSpares) {
		delete(f.zone.crossSince, i)
		return false
	}
	if endgame || (rank == 0 && !coming) {
		return true
	}
	since, seen := f.zone.crossSince[i]
	if !seen {
		f.zone.crossSince[i] = now
		return false
	}
	holdoff := f.holdoff()
	if f.chunkTime == 0 {
		holdoff = maxHoldoff // no chunk has come yet: how long one takes is unknown
	}
	wait := time.Duration(rank) * holdoff
	if coming {
		wait = time.Duration(2*(rank+1)) * holdoff
	}
	return now.Sub(since) >= wait
}

// zoneRank is this node's place among the zone's nodes that fill the blob
// in chunk i's rendezvous order: 0 makes it the chunk's entry. Every node
// of the zone hears about the same holders, so they agree on the order,
// and the zone's downlinks share the crossings.
func (f *plan) zoneRank(i int, now time.Time) int {
	if f.zone.names == nil || now.Sub(f.zone.namesAt) >= f.refreshEvery() {
		f.zoneNames(now)
	}
	if r, ok := f.zone.ranks[i]; ok {
		return r
	}
	key := mix64(uint64(i) + 0x9e3779b97f4a7c15)
	mine, r := mix64(f.zone.hashes[0]^key), 0
	for _, h := range f.zone.hashes[1:] {
		if mix64(h^key) > mine {
			r++
		}
	}
	f.zone.ranks[i] = r
	return r
}

// zoneNames gathers the zone's nodes that fill the blob: the holders
// gossip named at the last follow that are not complete, or, in the fill's
// first Settle, before gossip names them, the zone's members (one that
// does not want the blob costs a chunk at most a Settle's wait).
func (f *plan) zoneNames(now time.Time) {
	local := f.s.dir.LocalName()
	names := []string{local}
	if now.Sub(f.start) < f.s.cfg.Settle {
		for _, m := range f.s.dir.Members() {
			if m.Meta.Zone == f.s.cfg.Zone && !f.s.Banned(m.Name) {
				names = append(names, m.Name)
			}
		}
	} else {
		for _, name := range f.holders[f.completes:] {
			if f.zoneOf(name) == f.s.cfg.Zone && !f.s.Banned(name) {
				names = append(names, name)
			}
		}
	}
	f.zone.namesAt = now
	if slices.Equal(names, f.zone.names) {
		return
	}
	f.zone.names, f.zone.hashes, f.zone.ranks = names, f.zone.hashes[:0], map[int]int{}
	for _, n := range names {
		f.zone.hashes = append(f.zone.hashes, rendezvousHash(f.d, n))
	}
}
