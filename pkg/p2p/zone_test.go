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

// A node asks peers of its zone first, whatever they can offer; a chunk
// that only peers outside its zone have crosses into it through one node,
// the zone's entry for that chunk, and the others wait for that copy, up
// to two holdoffs (the entry may not know it is one), but for the last
// chunks; an endgame duplicate never crosses while its zone has a copy.
func TestSupplierPrefersItsZone(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{Zone: "a"}, nil, nil)
	require.NoError(t, err)
	d := digest.FromString("blob")
	const chunks = 8
	state := func(have, fetching, sent byte, origin bool) PeerState {
		return PeerState{ChunkState: cache.ChunkState{Size: chunks * testChunk, ChunkSize: testChunk, Have: []byte{have}},
			Fetching: []byte{fetching}, Sent: []byte{sent}, Origin: origin}
	}
	// mate is a node of zone a that fills the blob too: the zone's chunks
	// are dealt between it and me.
	mateChunk, myChunk := -1, -1
	for i := range chunks {
		if rendezvous(d, []string{"me", "mate"})[i%2] == "me" {
			myChunk = i
		} else {
			mateChunk = i
		}
	}
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
	require.Equal(t, "me", f.zoneEntry(1, time.Now()), "this node brings chunk 1 into zone a")
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
