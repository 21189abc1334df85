package p2p

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
)

// The election's order puts each zone's first node before any zone's
// second, so the origin fetchers lie in as many zones as there are; in one
// zone, or with no zones, it is the rendezvous order.
func TestZoneOrder(t *testing.T) {
	t.Parallel()
	names := []string{"a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4"}
	for name, zones := range map[string]map[string]string{
		"no zones":  {},
		"one zone":  {"a1": "a", "a2": "a", "a3": "a", "a4": "a", "b1": "a", "b2": "a", "b3": "a", "b4": "a"},
		"two zones": {"a1": "a", "a2": "a", "a3": "a", "a4": "a", "b1": "b", "b2": "b", "b3": "b", "b4": "b"},
		"uneven":    {"a1": "a", "a2": "a", "a3": "a", "a4": "a", "b1": "a", "b2": "a", "b3": "a", "b4": "c"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			zoneOf := func(n string) string { return zones[n] }
			inZones := map[string]bool{}
			for _, n := range names {
				inZones[zoneOf(n)] = true
			}
			for i := range 50 {
				d := digest.FromString(fmt.Sprint(i))
				order := zoneOrder(d, names, zoneOf)
				require.ElementsMatch(t, names, order)
				firsts := map[string]bool{}
				for _, n := range order[:len(inZones)] {
					firsts[zoneOf(n)] = true
				}
				require.Len(t, firsts, len(inZones), "the first %d of %v lie in every zone", len(inZones), order)
				for z := range inZones {
					inZone := func(n string) bool { return zoneOf(n) != z }
					require.Equal(t, slices.DeleteFunc(rendezvous(d, names), inZone), slices.DeleteFunc(slices.Clone(order), inZone),
						"zone %q keeps its rendezvous order", z)
				}
				if len(inZones) == 1 {
					require.Equal(t, rendezvous(d, names), order)
				}
				reversed := slices.Clone(names)
				slices.Reverse(reversed)
				require.Equal(t, order, zoneOrder(d, reversed, zoneOf), "independent of input order")
			}
		})
	}
}

// zoneMates is a cluster, seen from "me" in zone a, whose gossip names
// the given holders of every blob, each filling it, in the zones given.
func zoneMates(zones map[string]string) gossipDir {
	dir := gossipDir{staticDir: staticDir{local: "me", peers: map[string]Peer{}}}
	for name, z := range zones {
		dir.peers[name] = Peer{Name: name, Meta: NodeMeta{ChunkAddr: "127.0.0.1:1", Zone: z}}
		dir.holders = append(dir.holders, Holder{Peer: name})
	}
	return dir
}

// A node asks peers of its zone first, whatever they can offer; a chunk
// that only peers outside its zone have crosses into it through one node,
// the zone's entry for that chunk, and the others wait for that copy, a
// holdoff per node ranked above them (the entry may not know it is one),
// but for the last chunks; an endgame duplicate never crosses while its
// zone has a copy.
func TestSupplierPrefersItsZone(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(zoneMates(map[string]string{"mate": "a", "far": "b"}), nil, SwarmConfig{Zone: "a"}, nil, nil)
	require.NoError(t, err)
	d := digest.FromString("blob")
	const chunks = 8
	state := func(have, fetching, sent byte, origin bool) PeerState {
		return PeerState{ChunkState: cache.ChunkState{Size: chunks * testChunk, ChunkSize: testChunk, Have: []byte{have}},
			Fetching: []byte{fetching}, Sent: []byte{sent}, Origin: origin}
	}
	// mate is a node of zone a that fills the blob too: each chunk enters
	// the zone through one of them.
	mateChunk, myChunk := -1, -1
	ranks := &plan{s: s, d: d}
	ranks.hearHolders(s.dir.Holders(d))
	for i := range chunks {
		if ranks.zoneRank(i, time.Now()) == 0 {
			myChunk = i
		} else {
			mateChunk = i
		}
	}
	require.True(t, mateChunk >= 0 && myChunk >= 0, "chunks enter through both")
	now := time.Now()
	for name, tc := range map[string]struct {
		chunk   int
		peers   []*peerView
		busy    string        // a peer with no request free
		waited  time.Duration // since the chunk was first seen outside the zone only
		endgame bool
		want    string // "" for none
	}{
		"a near relay beats a far holder": {chunk: myChunk, want: "near", peers: []*peerView{
			{name: "near", zone: "a", state: state(0, 0xff, 0, false)},
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
		}},
		"a near origin fetcher's repeat beats a far holder": {chunk: myChunk, want: "near", peers: []*peerView{
			{name: "near", zone: "a", state: state(0xff, 0, 0xff, true)},
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
		}},
		"far only, this node the entry": {chunk: myChunk, want: "far", peers: []*peerView{
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
			{name: "mate", zone: "a", state: state(0, 0, 0, false)},
		}},
		"far only, the mate the entry": {chunk: mateChunk, want: "", peers: []*peerView{
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
			{name: "mate", zone: "a", state: state(0, 0, 0, false)},
		}},
		"far only, the mate the entry for too long": {chunk: mateChunk, want: "far", waited: time.Minute, peers: []*peerView{
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
			{name: "mate", zone: "a", state: state(0, 0, 0, false)},
		}},
		"the near holder is busy: wait for it": {chunk: myChunk, want: "", busy: "near", peers: []*peerView{
			{name: "near", zone: "a", state: state(0xff, 0, 0, false)},
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
		}},
		"an endgame duplicate waits for a near copy": {chunk: myChunk, want: "", busy: "near", endgame: true, peers: []*peerView{
			{name: "near", zone: "a", state: state(0xff, 0, 0, false)},
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
		}},
		"the last chunks cross at once": {chunk: mateChunk, want: "far", endgame: true, peers: []*peerView{
			{name: "far", zone: "b", state: state(0xff, 0, 0, false)},
			{name: "mate", zone: "a", state: state(0, 0, 0, false)},
		}},
		"one zone: the best supplier": {chunk: myChunk, want: "holder", peers: []*peerView{
			{name: "holder", zone: "a", state: state(0xff, 0, 0, false)},
			{name: "relay", zone: "a", state: state(0, 0xff, 0, false)},
		}},
	} {
		t.Run(name, func(t *testing.T) {
			f := &plan{s: s, d: d, inflight: map[int]int{}, asked: map[int][]string{}}
			f.hearHolders(s.dir.Holders(d))
			for _, pv := range tc.peers {
				pv.known = true
				f.peers.add(pv)
			}
			if tc.busy != "" {
				s.requestCounter(tc.busy).Store(int32(s.cfg.PerPeer))
				defer s.requestCounter(tc.busy).Store(0)
			}
			if tc.waited > 0 {
				f.zone.crossSince = map[int]time.Time{tc.chunk: now.Add(-tc.waited)}
			}
			pick, _ := f.supplierOf(tc.chunk, tc.endgame, now)
			if tc.want == "" {
				require.Nil(t, pick)
				return
			}
			require.NotNil(t, pick)
			require.Equal(t, tc.want, pick.name)
		})
	}
}

// The nodes of a zone agree on each chunk's order among them, from the
// holders gossip names (in the fill's first Settle, the zone's members);
// the entry crosses at once, the k-th after it once the chunk has been
// outside the zone only for k holdoffs (the longest holdoff before a chunk
// has come). A zone copy holds every node back, but for the chunk's first
// zoneSpares nodes when they gave up copies of it as too slow, or the
// zone's copy has only been on its way for 2×(rank+1) holdoffs.
func TestZoneCrossingsGoByRank(t *testing.T) {
	t.Parallel()
	mates := map[string]string{"far": "b", "gone": "a"}
	for i := range 6 {
		mates[fmt.Sprintf("mate-%d", i)] = "a"
	}
	dir := zoneMates(mates)
	dir.holders = slices.DeleteFunc(dir.holders, func(h Holder) bool { return h.Peer == "gone" })
	s, err := NewSwarm(dir, nil, SwarmConfig{Zone: "a"}, nil, nil)
	require.NoError(t, err)
	d := digest.FromString("blob")
	now := time.Now()

	// Every node of zone a ranks itself alike: each chunk has one entry.
	zoneA := []string{"me", "mate-0", "mate-1", "mate-2", "mate-3", "mate-4", "mate-5"}
	rankOf := func(name string, i int, start time.Time) int {
		others := map[string]string{}
		for n, z := range mates {
			if n != name {
				others[n] = z
			}
		}
		if name != "me" {
			others["me"] = "a"
		}
		view := zoneMates(others)
		view.local = name
		view.holders = slices.DeleteFunc(view.holders, func(h Holder) bool { return h.Peer == "gone" })
		vs, err := NewSwarm(view, nil, SwarmConfig{Zone: "a"}, nil, nil)
		require.NoError(t, err)
		f := &plan{s: vs, d: d, start: start}
		f.hearHolders(view.Holders(d))
		return f.zoneRank(i, now)
	}
	for i := range 16 {
		var ranks []int
		for _, n := range zoneA {
			ranks = append(ranks, rankOf(n, i, time.Time{}))
		}
		slices.Sort(ranks)
		require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6}, ranks, "chunk %d", i)
	}
	differs := false
	for i := range 16 {
		differs = differs || rankOf("me", i, now) != rankOf("me", i, time.Time{})
	}
	require.True(t, differs, "in the first Settle the members count, a member that fills nothing too")

	chunk := -1
	for i := range 64 {
		if rankOf("me", i, time.Time{}) == 2 {
			chunk = i
			break
		}
	}
	require.GreaterOrEqual(t, chunk, 0)
	f := &plan{s: s, d: d, givenUp: map[int]int{}}
	f.hearHolders(dir.Holders(d))
	require.False(t, f.mayCrossZone(chunk, false, false, false, now), "first seen outside only")
	require.False(t, f.mayCrossZone(chunk, false, false, false, now.Add(2*maxHoldoff-time.Millisecond)), "third: no chunk has come yet")
	require.True(t, f.mayCrossZone(chunk, false, false, false, now.Add(2*maxHoldoff)), "two holdoffs on")

	f.chunkTime = time.Second
	require.False(t, f.mayCrossZone(chunk, true, true, false, now), "a zone copy")
	require.False(t, f.mayCrossZone(chunk, false, false, false, now), "outside only again: the wait starts over")
	require.True(t, f.mayCrossZone(chunk, false, false, false, now.Add(2*f.holdoff())))

	for i := range 64 {
		if rankOf("me", i, time.Time{}) == 1 {
			require.False(t, f.mayCrossZone(i, false, false, false, now))
			require.True(t, f.mayCrossZone(i, false, false, false, now.Add(f.holdoff())), "second: one holdoff on")
			break
		}
	}

	f.zone.crossSince = nil
	require.False(t, f.mayCrossZone(chunk, true, false, false, now), "the zone's copy on its way: the wait starts")
	require.False(t, f.mayCrossZone(chunk, true, false, false, now.Add(6*f.holdoff()-time.Millisecond)))
	require.True(t, f.mayCrossZone(chunk, true, false, false, now.Add(6*f.holdoff())), "among the first three, it crosses after 2×(rank+1) holdoffs")
	require.False(t, f.mayCrossZone(chunk, true, true, false, now.Add(time.Hour)), "a zone peer has it")
	f.givenUp[chunk] = 1
	require.False(t, f.mayCrossZone(chunk, true, true, false, now), "a zone peer has it, but its copy was given up as too slow")
	require.True(t, f.mayCrossZone(chunk, true, true, false, now.Add(2*f.holdoff())), "a holdoff per node ranked above")
	for i := range 64 {
		if rankOf("me", i, time.Time{}) >= zoneSpares {
			f.givenUp[i] = 1
			require.False(t, f.mayCrossZone(i, true, true, false, now))
			require.False(t, f.mayCrossZone(i, true, false, false, now.Add(time.Hour)), "later in the order, it waits for the zone's copy")
			break
		}
	}
}

// With zones, the members that take the origin role at once are the first
// of the zone-aware order: one per zone before a second in any.
func TestOriginRoleSpreadsOverZones(t *testing.T) {
	t.Parallel()
	zones := map[string]string{"me": "a", "a2": "a", "a3": "a", "b1": "b", "b2": "b", "b3": "b"}
	dir := staticDir{local: "me", peers: map[string]Peer{}}
	for n, z := range zones {
		if n != "me" {
			dir.peers[n] = Peer{Name: n, Meta: NodeMeta{ChunkAddr: "127.0.0.1:1", Zone: z}}
		}
	}
	s, err := NewSwarm(dir, nil, SwarmConfig{Settle: time.Hour, Zone: "a"}, nil, nil)
	require.NoError(t, err)
	names := []string{"me", "a2", "a3", "b1", "b2", "b3"}
	differs := 0
	for i := range 40 {
		d := digest.FromString(fmt.Sprint(i))
		rank := slices.Index(zoneOrder(d, names, func(n string) string { return zones[n] }), "me")
		if (rank < s.cfg.OriginFetchers) != (slices.Index(rendezvous(d, names), "me") < s.cfg.OriginFetchers) {
			differs++
		}
		f := &plan{s: s, d: d, start: time.Now(), maxInFlight: 8}
		f.decideOrigin()
		require.Equal(t, rank < s.cfg.OriginFetchers, f.originRole, "blob %d: rank %d", i, rank)
	}
	require.Positive(t, differs, "the zones changed some elections")
}

// A chunk this node brings into its zone goes before rarer ones from its
// zone: the zone's other nodes wait for it.
func TestZoneEntryFetchesItsCrossingFirst(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{Zone: "a"}, nil, nil)
	require.NoError(t, err)
	state := func(have byte) PeerState {
		return PeerState{ChunkState: cache.ChunkState{Size: 2 * testChunk, ChunkSize: testChunk, Have: []byte{have}}}
	}
	f := &plan{s: s, d: digest.FromString("blob"), inflight: map[int]int{}, asked: map[int][]string{}, peers: peersOf(
		&peerView{name: "near", zone: "a", known: true, state: state(0b01)},
		&peerView{name: "far1", zone: "b", known: true, state: state(0b10)},
		&peerView{name: "far2", zone: "b", known: true, state: state(0b10)},
		&peerView{name: "far3", zone: "b", known: true, state: state(0b10)},
	)}
	require.Zero(t, f.zoneRank(1, time.Now()), "this node brings chunk 1 into zone a")
	chunk, peer := f.pickFromPeers([]int{0, 1}, false)
	require.Equal(t, 1, chunk, "the chunk only zone b has, though three hold it and one chunk 0")
	require.Equal(t, "b", peer.zone)
}

// The bytes a node receives from peers of other zones are counted, for
// operators to see what crosses zones.
func TestCrossZoneBytesAreCounted(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{Zone: "a"}, nil, nil)
	require.NoError(t, err)
	f := &plan{s: s, inflight: map[int]int{0: 1, 1: 1, 2: 1}, peers: peersOf(
		&peerView{name: "near", zone: "a", inflight: 1}, &peerView{name: "far", zone: "b", inflight: 1},
	)}
	f.originInflight = 1
	require.NoError(t, f.handle(chunkResult{chunk: 0, peer: "near", bytes: 100}))
	require.NoError(t, f.handle(chunkResult{chunk: 1, peer: "far", bytes: 10}))
	require.NoError(t, f.handle(chunkResult{chunk: 2, bytes: 1000}))
	require.Equal(t, 10.0, testutil.ToFloat64(s.m.crossZone), "only the far peer's chunk")
}
