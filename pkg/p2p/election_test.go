package p2p

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// slowOrigin is an origin whose every range takes delay to open.
type slowOrigin struct {
	*countingOrigin
	delay time.Duration
}

func (o slowOrigin) OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error) {
	select {
	case <-time.After(o.delay):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return o.countingOrigin.OpenBoundedRange(ctx, off, n)
}

// An origin fetcher that is done with its share takes over part of a slower
// fetcher's, and the origin still sends one copy. Where the two meet, a
// chunk each started before word of the other's came goes twice: on a
// loaded machine, whose state reads lag, up to three. Eighty chunks keep
// that within the bound, as a blob's hundreds of chunks do. On the
// simulation's clock, whose lag is exact: internal/swarmsim's
// TestASlowOriginFetcherIsHelped.
func TestOriginFetcherHelpsASlowerOne(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 4, nil)
	data := randomBlob(12, 80*testChunk)
	var names []string
	for _, n := range nodes {
		names = append(names, n.name)
	}
	fetchers := rendezvous(descOf(data).Digest, names)[:2] // in share order
	origin := &countingOrigin{data: data}
	require.NoError(t, fetchAll(nodes, data, 30*time.Second, func(n *swarmNode) content.RangeOpener {
		if n.name == fetchers[0] {
			return slowOrigin{origin, 600 * time.Millisecond}
		}
		return slowOrigin{origin, 150 * time.Millisecond}
	}))
	fromOrigin := map[string]float64{}
	for _, n := range nodes {
		fromOrigin[n.name] = testutil.ToFloat64(n.swarm.m.received.WithLabelValues("origin"))
	}
	t.Logf("origin served %.2f copies; by node: %v", float64(origin.sent.Load())/float64(len(data)), fromOrigin)
	require.LessOrEqual(t, float64(origin.sent.Load())/float64(len(data)), 1.05, "the origin serves about one copy")
	require.Greater(t, fromOrigin[fetchers[1]], float64(len(data))/2, "the faster fetcher took part of the slower one's share")
}

func TestRendezvousIsStable(t *testing.T) {
	t.Parallel()
	d := digest.FromString("blob")
	names := []string{"a", "b", "c", "d", "e"}
	order := rendezvous(d, names)
	require.ElementsMatch(t, names, order)
	require.Equal(t, order, rendezvous(d, []string{"e", "d", "c", "b", "a"}), "independent of input order")
	without := rendezvous(d, append(append([]string{}, order[:2]...), order[3:]...))
	require.Equal(t, append(append([]string{}, order[:2]...), order[3:]...), without, "removing one keeps the rest in order")
	other := rendezvous(digest.FromString("another"), names)
	firsts := map[string]bool{order[0]: true, other[0]: true}
	for i := range 20 {
		firsts[rendezvous(digest.FromString(fmt.Sprint(i)), names)[0]] = true
	}
	require.Greater(t, len(firsts), 2, "different blobs pick different origin fetchers")
}

// Every node is ranked first for about its share of blobs, also where the
// node names differ only in their last character, as Kubernetes node names
// often do: otherwise one node fetches most blobs from the origin.
func TestRendezvousSpreadsTheFirstRank(t *testing.T) {
	t.Parallel()
	for _, names := range [][]string{
		{"node-1", "node-2", "node-3", "node-4", "node-5", "node-6", "node-7", "node-8"},
		{"me", "a", "b", "c", "d"},
		{"gpu-a100-0", "gpu-a100-1", "gpu-a100-2", "gpu-a100-3"},
	} {
		const blobs = 8000
		first := map[string]int{}
		for i := range blobs {
			first[rendezvous(digest.FromString(fmt.Sprint(i)), names)[0]]++
		}
		fair := blobs / len(names)
		for _, n := range names {
			assert.InDelta(t, fair, first[n], float64(fair)/5, "%s is first for %d of %d blobs among %v", n, first[n], blobs, names)
		}
	}
}

// Gossip missed that the member ranked first for a blob holds it: the node
// asks that member directly and fetches from it, where it would otherwise
// take the origin role; the members that hold nothing answer 404. Settle is
// long so that a slow state read under a busy machine cannot end the wait
// ("me" ranks first, and takes the role at once if it follows no one).
func TestSwarmAsksTheFirstRankedMembers(t *testing.T) {
	t.Parallel()
	data := randomBlob(18, 3*testChunk)
	d := descOf(data).Digest
	_, holder := serveStore(t, storeHolding(t, data))
	_, empty := serveStore(t, newTestStore(t))
	dir := staticDir{local: "me", peers: map[string]Peer{}}
	first := slices.DeleteFunc(rendezvous(d, []string{"me", "a", "b", "c"}), func(n string) bool { return n == "me" })[0]
	for _, name := range []string{"a", "b", "c"} {
		addr := empty.URL
		if name == first {
			addr = holder.URL
		}
		dir.peers[name] = Peer{Name: name, Meta: NodeMeta{ChunkAddr: strings.TrimPrefix(addr, "http://")}}
	}
	s, err := NewSwarm(dir, nil, SwarmConfig{Settle: time.Hour}, nil, nil)
	require.NoError(t, err)
	store := newTestStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = store.Fetch(ctx, descOf(data), s.Source(descOf(data), Origin{RangeOpener: originGone{}}), nil)
	require.NoError(t, err, "fetched from the first-ranked member, not the origin")
	require.False(t, s.FetchesFromOrigin(d))
}

// A node among the first OriginFetchers of all members in a blob's order
// takes the origin role at once and may ask the origin straight away; the
// others wait their turn.
func TestFirstRankedMemberTakesTheOriginRoleAtOnce(t *testing.T) {
	t.Parallel()
	names := []string{"me", "a", "b", "c"}
	dir := staticDir{local: "me", peers: map[string]Peer{}}
	for _, n := range names[1:] {
		dir.peers[n] = Peer{Name: n, Meta: NodeMeta{ChunkAddr: "127.0.0.1:1"}}
	}
	s, err := NewSwarm(dir, nil, SwarmConfig{Settle: time.Hour}, nil, nil)
	require.NoError(t, err)
	for i := range 8 {
		d := descOf(randomBlob(uint64(30+i), testChunk)).Digest
		rank := slices.Index(rendezvous(d, names), "me")
		f := &plan{s: s, d: d, start: time.Now(), maxInFlight: 8}
		f.decideOrigin()
		require.Equal(t, rank < s.cfg.OriginFetchers, f.originRole, "rank %d of %d", rank, len(names))
		require.Equal(t, f.originRole, f.useOrigin(), "rank %d: no node can rank above it, nothing to wait for", rank)
	}
}

// An origin fetcher takes its own share from the front; with its share done
// it takes another fetcher's from the back (where the origin is slow enough
// for word of requests to keep up), and neither fetches a chunk the other
// says it is fetching.
func TestOriginFetchersMeetFromOppositeEnds(t *testing.T) {
	t.Parallel()
	f, other := twoOriginFetchers(t)
	f.s.cfg.OriginInFlight = 2 // the other's requests in flight: what a helper leaves it
	share, _ := f.originShare()
	var mine, theirs []int
	for i := range 8 {
		if i%2 == share {
			mine = append(mine, i)
		} else {
			theirs = append(theirs, i)
		}
	}
	all := []int{0, 1, 2, 3, 4, 5, 6, 7}

	require.Equal(t, mine[0], f.nextFromOrigin(slices.Clone(all)), "its own share, from the front")
	other.state.Fetching = setBit(nil, mine[0], true)
	require.Equal(t, mine[1], f.nextFromOrigin(slices.Clone(all)), "not what the other fetches")

	other.state.Fetching = setBit(nil, theirs[0], true)
	f.originTime = time.Millisecond
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(theirs)), "its share done; the origin sends a chunk sooner than word of a request travels")
	f.originTime = time.Second
	require.Equal(t, theirs[3], f.nextFromOrigin(slices.Clone(theirs)), "its share done: the other's, from the back")
	f.inflight[theirs[3]] = 1
	other.state.Have = setBit([]byte{0}, theirs[1], true)
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(theirs)), "the other's next two chunks are left to it")
}

// A helper leaves a fetcher its requests in flight again, but one far
// slower (a slow downlink: its chunks take it ten times the helper's origin
// chunk time) would take those at its pace while every node waits: it is
// left what it starts within a state lag, none here. The pace is what the
// fetcher's states show: how often it comes to hold one more chunk.
func TestHelperLeavesAFarSlowerFetcherNothing(t *testing.T) {
	t.Parallel()
	f, other := twoOriginFetchers(t)
	f.s.cfg.OriginInFlight = 2
	f.originTime = time.Second
	theirs := otherShare(f, 8)
	f.inflight[theirs[3]] = 1
	other.state.Have, other.state.Fetching = setBit([]byte{0}, theirs[0], true), setBit(nil, theirs[1], true)
	at := time.Now()
	fetcherPace(other, 1, at)
	cameAfter := func(every time.Duration) { // one more chunk held
		at = at.Add(every)
		fetcherPace(other, other.held+1, at)
	}

	cameAfter(1500 * time.Millisecond)
	require.Equal(t, 3*time.Second, f.fetcherChunkTime(other), "two requests in flight, a chunk each 1.5 s")
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(theirs)), "at about its pace: its next two chunks are left to it")
	cameAfter(15 * time.Second)
	require.Equal(t, (3*1500*time.Millisecond+15*time.Second)/4, other.chunkEvery, "a moving average")
	require.Equal(t, theirs[2], f.nextFromOrigin(slices.Clone(theirs)), "far slower: helped to its last chunk")

	// Quicker than word of a request travels, helping would fetch chunks
	// twice: a fetcher 20 times slower than a fast origin is not helped.
	f.originTime, other.chunkEvery, f.s.cfg.OriginInFlight = 2*time.Millisecond, 0, 1
	cameAfter(40 * time.Millisecond)
	require.Less(t, f.fetcherChunkTime(other), f.stateLag())
	other.state.Have, other.state.Fetching = []byte{0}, nil
	delete(f.inflight, theirs[3])
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(theirs)), "no slower than a state lag: not helped")
}

// A fetcher's states come every Refresh or so, and far less often on a
// loaded node, and its chunks can come and go between two: timing each
// chunk from seen on its way to seen held times the reads, not the
// fetcher. Over a fast origin, a fetcher whose states came 150 ms apart
// was judged to take 150 ms a chunk, far slower than this one's 1 ms, and
// both "helped" each other's shares from the back (1.2 copies from the
// origin in CI). Its pace is the chunks it came to hold between states.
func TestFetcherPaceIsItsChunksNotItsReads(t *testing.T) {
	t.Parallel()
	clock := time.Unix(1000, 0)
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{Now: func() time.Time { return clock }}, nil, nil)
	require.NoError(t, err)
	const chunks = 64
	desc := content.Descriptor{Digest: descOf(randomBlob(45, testChunk)).Digest, Size: chunks * testChunk}
	f := s.newPlan(desc, testChunk, nil)
	f.originRole, f.originTime = true, time.Millisecond
	other := &peerView{name: "other", known: true, state: PeerState{Origin: true}}
	f.peers = peersOf(other)
	// other's state after it fetched k of its share, with the next 3 on their
	// way; its share is every other chunk, from the front.
	_, fetchers := f.originShare()
	require.Len(t, fetchers, 2)
	theirs := otherShare(f, chunks)
	stateAfter := func(k int) PeerState {
		st := PeerState{ChunkState: cache.ChunkState{Size: desc.Size, ChunkSize: testChunk, Have: make([]byte, chunks/8)}, Origin: true}
		for _, i := range theirs[:k] {
			st.Have = setBit(st.Have, i, true)
		}
		for _, i := range theirs[k : k+3] {
			st.Fetching = setBit(st.Fetching, i, true)
		}
		return st
	}
	for step := range 4 {
		f.updateState(stateResult{peer: "other", state: stateAfter(step * 6)})
		clock = clock.Add(150 * time.Millisecond)
	}
	require.Greater(t, f.stateLag(), 100*time.Millisecond)
	missing := slices.Clone(theirs[18+3:])
	require.Equal(t, -1, f.nextFromOrigin(missing),
		"6 chunks every 150 ms: not far slower, and left what it fetches within a state lag")

	// One that comes to hold a chunk every 150 ms is far slower than 1 ms a
	// chunk: it is left what it starts within a state lag, and helped.
	for step := range 4 {
		f.updateState(stateResult{peer: "other", state: stateAfter(18 + step)})
		clock = clock.Add(150 * time.Millisecond)
	}
	missing = slices.Clone(theirs[21+3:])
	require.Equal(t, theirs[len(theirs)-1], f.nextFromOrigin(missing), "far slower: helped from the back")
}

// A peer whose state read fails claims nothing: neither the origin role
// nor chunks on their way to it hold back the chunks it named. A fetcher
// killed mid-transfer is still a member for seconds, and then kept for
// peerGrace: until then its last state kept its share and its chunks in
// flight from every other fetcher (a 3.5 s fill took 17 s).
func TestUnreachableFetcherClaimsNothing(t *testing.T) {
	t.Parallel()
	f, other := twoOriginFetchers(t)
	share, _ := f.originShare()
	other.state.Fetching = setBit(nil, share, true)
	all := []int{0, 1, 2, 3, 4, 5, 6, 7}
	require.Equal(t, share+2, f.nextFromOrigin(slices.Clone(all)), "its first chunk is on its way to the other")

	f.updateState(stateResult{peer: "other", err: errors.New("connection refused")})
	_, fetchers := f.originShare()
	require.Equal(t, []string{"me"}, fetchers, "the other fetches nothing it can send")
	require.Equal(t, 0, f.nextFromOrigin(slices.Clone(all)), "every chunk is this node's, from the front")
}

// An origin fetcher with chunks left to fetch from the origin keeps most of
// its downlink for them: only fetcherPeerRequests requests go to peers.
func TestOriginFetcherBoundsItsPeerRequests(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	other := &peerView{name: "other", known: true, inflight: fetcherPeerRequests,
		state: PeerState{ChunkState: cache.ChunkState{Size: 4 * testChunk, ChunkSize: testChunk, Have: []byte{0b0001}}}}
	f := &plan{s: s, inflight: map[int]int{}, peers: peersOf(other)}
	missing := []int{0, 1, 2, 3}

	require.True(t, f.mayAskPeers(fetcherPeerRequests, missing), "not an origin fetcher")
	f.originRole = true
	require.False(t, f.mayAskPeers(fetcherPeerRequests, missing), "chunks 1 to 3 are still to come from the origin")
	other.inflight--
	require.True(t, f.mayAskPeers(fetcherPeerRequests-1, missing), "under the bound")
	other.inflight++
	other.state.Have = []byte{0b1111}
	require.True(t, f.mayAskPeers(fetcherPeerRequests, missing), "a peer holds every chunk: no origin work left")
	f.originInflight = 1
	require.False(t, f.mayAskPeers(fetcherPeerRequests+1, missing), "a request to the origin is still in flight")
}

// A fill that ends lets the origin role linger for its peers, on the
// swarm's clock; a later fill of the same blob that takes the role keeps it
// when the first one's lingering ends.
func TestOriginRoleOutlivesAnEarlierFillsLinger(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 4, 0, 0, 0, 0, time.UTC)
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{OriginLinger: time.Minute, Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	d := descOf(randomBlob(40, testChunk)).Digest
	first := &plan{s: s, d: d, start: now, maxInFlight: 8}
	first.decideOrigin()
	require.True(t, first.originRole, "alone, it fetches from the origin")
	first.release() // failed: the download is retried
	now = now.Add(59 * time.Second)
	require.True(t, s.FetchesFromOrigin(d), "lingering")
	retry := &plan{s: s, d: d, start: now, maxInFlight: 8}
	retry.decideOrigin()
	require.True(t, retry.originRole)
	now = now.Add(time.Hour)
	require.True(t, s.FetchesFromOrigin(d), "the retry still fetches from the origin, and peers must see it")
	retry.release()
	now = now.Add(59 * time.Second)
	require.True(t, s.FetchesFromOrigin(d), "lingering after the retry")
	now = now.Add(time.Second)
	require.False(t, s.FetchesFromOrigin(d), "a minute after the last fill ended")
}

// A node that yields the origin role to fetchers ranked above it stops
// fetching from the origin, and its peers stop counting it among the
// fetchers at once: were it still seen for OriginLinger, the chunks split
// among the fetchers would give it a share that nobody fetches but the
// others' helpers, each from the back of the same share.
func TestYieldedOriginRoleIsNotSeen(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{OriginLinger: time.Minute, Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	var d digest.Digest
	for i := uint64(0); d == ""; i++ {
		if c := descOf(randomBlob(200+i, testChunk)).Digest; rendezvous(c, []string{"me", "a", "b"})[2] == "me" {
			d = c
		}
	}
	fetcher := func(name string) *peerView {
		return &peerView{name: name, known: true, state: PeerState{ChunkState: cache.ChunkState{Size: 8 * testChunk, ChunkSize: testChunk, Have: []byte{0}}, Origin: true}}
	}
	f := &plan{s: s, d: d, start: now, maxInFlight: 8}
	f.decideOrigin()
	require.True(t, f.originRole, "alone, it fetches from the origin")
	require.True(t, s.FetchesFromOrigin(d))

	f.peers = peersOf(fetcher("a"), fetcher("b"))
	f.decideOrigin()
	require.False(t, f.originRole, "two fetchers rank above it: it yields")
	require.False(t, s.FetchesFromOrigin(d), "peers no longer see it fetch")
	f.release()
	require.False(t, s.FetchesFromOrigin(d), "nor after its fill ends")
}

// A node ranked among the first OriginFetchers of all members takes the
// origin role at once; one ranked lower, with no peer known to hold or
// fetch the blob, waits one Settle first. Measured on the swarm's clock: a
// table of ranks and elapsed times, no sleeping.
func TestOriginTurnByRank(t *testing.T) {
	t.Parallel()
	names := []string{"me", "a", "b", "c", "d"}
	dir := staticDir{local: "me", peers: map[string]Peer{}}
	for _, n := range names[1:] {
		dir.peers[n] = Peer{Name: n, Meta: NodeMeta{ChunkAddr: "127.0.0.1:1"}}
	}
	start := time.Date(2026, 12, 4, 0, 0, 0, 0, time.UTC)
	var now time.Time
	s, err := NewSwarm(dir, nil, SwarmConfig{Settle: time.Second, Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	ranked := map[int]digest.Digest{} // rank of "me" → a blob where it has that rank
	for i := uint64(0); len(ranked) < len(names); i++ {
		d := descOf(randomBlob(100+i, testChunk)).Digest
		if r := slices.Index(rendezvous(d, names), "me"); ranked[r] == "" {
			ranked[r] = d
		}
	}
	for _, c := range []struct {
		rank    int
		elapsed time.Duration
		takes   bool
	}{
		{0, 0, true}, {1, 0, true}, // among the first two of all members: at once
		{2, 0, false}, {2, time.Second - 1, false}, {2, time.Second, true},
		{3, time.Second - 1, false}, {3, time.Second, true},
		{4, 0, false}, {4, time.Hour, true},
	} {
		now = start.Add(c.elapsed)
		f := &plan{s: s, d: ranked[c.rank], start: start, maxInFlight: 8}
		f.decideOrigin()
		require.Equal(t, c.takes, f.originRole, "rank %d after %v", c.rank, c.elapsed)
		f.release()
	}
}

// A node that took the origin role at its turn, below nodes that may have
// taken it too, lets peers see it fetch, and asks the origin, only once
// each of them has answered a state read sent after it took the role: it
// yields before the origin sends it a byte however late word of them
// comes, and its peers never split the chunks with it. A rival that does
// not answer holds it up for a state read's wait at most.
func TestOriginRoleByTurnWaitsForWordFromAbove(t *testing.T) {
	t.Parallel()
	names := []string{"me", "a", "b"}
	now := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	s, desc := swarmAt(t, names, &now), blobRanked(names, 2, 300)
	// answer delivers peer's state, read from sent on.
	answer := func(f *plan, peer string, sent time.Time, origin bool) {
		pv := f.peers.get(peer)
		pv.reading, pv.readAt = true, sent
		f.updateState(stateResult{peer: peer, state: PeerState{
			ChunkState: cache.ChunkState{Size: desc.Size, ChunkSize: testChunk, Have: []byte{0}}, Origin: origin}})
	}
	newPlan := func() *plan {
		start := now.Add(time.Hour) // past the last plan's linger
		f := &plan{s: s, desc: desc, d: desc.Digest, chunkSize: testChunk, chunks: 8, start: start,
			absent: map[string]time.Time{}, maxInFlight: 8}
		for _, n := range names[1:] {
			f.peers.add(&peerView{name: n, chunkBusy: map[int]time.Time{}, sentSeen: map[int]time.Time{}})
			answer(f, n, start, false) // neither fetches yet
		}
		now = start.Add(2 * s.cfg.Settle) // its turn, ranked third
		f.decideOrigin()
		require.True(t, f.originRole, "the nodes ranked above it have not taken the role")
		return f
	}
	seen := func(f *plan) bool {
		f.decideOrigin()
		require.Equal(t, f.useOrigin(), s.FetchesFromOrigin(desc.Digest), "it asks the origin when peers see it fetch")
		return f.useOrigin()
	}

	f := newPlan()
	now = now.Add(s.cfg.Settle / 2)
	require.False(t, seen(f), "no word from above since it took the role")
	answer(f, "a", f.originSince.Add(-time.Millisecond), false)
	require.False(t, seen(f), "a's answer to a read sent before it took the role says nothing")
	answer(f, "a", f.originSince, false)
	require.False(t, seen(f), "b is still unheard")
	answer(f, "b", f.originSince.Add(time.Millisecond), false)
	require.True(t, seen(f), "both answered: neither fetches")
	f.release()

	f = newPlan()
	answer(f, "a", f.originSince, true)
	answer(f, "b", f.originSince, true)
	now = now.Add(s.cfg.Settle / 2)
	require.False(t, seen(f))
	require.False(t, f.originRole, "both took the role: it yields, never seen")
	f.release()
	require.False(t, s.FetchesFromOrigin(desc.Digest), "never seen: nothing lingers")

	f = newPlan()
	now = now.Add(s.cfg.Settle / 2)
	pv := f.peers.get("a")
	pv.reading, pv.readAt = true, f.originSince
	f.updateState(stateResult{peer: "a", err: errors.New("connection refused")})
	answer(f, "b", f.originSince, false)
	require.True(t, seen(f), "a read that failed is word too: a rival gone (killed, not yet out of the membership) fetches nothing")
	f.release()

	f = newPlan()
	now = now.Add(s.cfg.Settle/4 + stateWait)
	require.True(t, seen(f), "unheard for a state read's wait: it goes ahead")
	f.release()
}

// A node among the first of all members takes the origin role at once and
// counts the other first member among the fetchers for Settle, whatever it
// says (it may start its own fill a moment later), and then until it
// answers a state read sent after that: a busy node's answers lag by more
// than Settle, and dropping a fetcher from the split early fetches its
// chunks twice. Without an answer it is dropped after a state read's wait.
// An answer that it fills the blob but has not taken the role does not
// drop it while it may wait on holders it has not heard; one that it holds
// none, or an error, does.
func TestFirstMembersCountEachOtherUntilWordSaysOtherwise(t *testing.T) {
	t.Parallel()
	names := []string{"me", "a", "b"}
	start := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	now := start
	s, desc := swarmAt(t, names, &now), blobRanked(names, 0, 400)
	other := rendezvous(desc.Digest, names)[1]
	f := &plan{s: s, desc: desc, d: desc.Digest, chunkSize: testChunk, chunks: 8, start: start,
		peers:  peersOf(&peerView{name: other, chunkBusy: map[int]time.Time{}, sentSeen: map[int]time.Time{}}),
		absent: map[string]time.Time{}, maxInFlight: 8}
	answer := func(sent time.Time, err error) {
		pv := f.peers.get(other)
		pv.reading, pv.readAt = true, sent
		f.updateState(stateResult{peer: other, err: err, state: PeerState{
			ChunkState: cache.ChunkState{Size: desc.Size, ChunkSize: testChunk, Have: []byte{0}}}})
	}
	fetchers := func() []string {
		_, names := f.originShare()
		return names
	}
	answer(start, nil)
	f.decideOrigin()
	require.True(t, f.originRole)
	require.True(t, f.useOrigin(), "first of all members: at once")
	require.Len(t, fetchers(), 2, "within Settle it counts, though it says it does not fetch")
	now = start.Add(s.cfg.Settle)
	require.Len(t, fetchers(), 2, "no word since Settle")
	answer(start.Add(s.cfg.Settle-time.Millisecond), nil)
	require.Len(t, fetchers(), 2, "word from a read sent before Settle ended")

	f.peers.get(other).heardAt = start // its word lost
	now = start.Add(s.cfg.Settle + stateWait)
	require.Equal(t, []string{"me"}, fetchers(), "no word for a state read's wait")

	answer(start.Add(s.cfg.Settle), nil)
	require.Len(t, fetchers(), 2, "it fills the blob, and may wait on holders it has not heard")
	now = start.Add(f.holdersWait() + stateWait)
	require.Equal(t, []string{"me"}, fetchers(), "it did not take the role while it may have waited")

	now = start.Add(s.cfg.Settle + stateWait)
	answer(start.Add(s.cfg.Settle), errors.New("connection refused"))
	require.Equal(t, []string{"me"}, fetchers(), "it did not answer, after Settle")
	answer(start.Add(s.cfg.Settle), errNotHeld)
	require.Equal(t, []string{"me"}, fetchers(), "it holds none, after Settle")
}

// clusterOf is a cluster of names, the first of them the local node.
func clusterOf(names []string) staticDir {
	dir := staticDir{local: names[0], peers: map[string]Peer{}}
	for _, n := range names[1:] {
		dir.peers[n] = Peer{Name: n, Meta: NodeMeta{ChunkAddr: "127.0.0.1:1"}}
	}
	return dir
}

// blobRanked is a blob of 8 chunks for which names[0] has rank among
// names in rendezvous order, the first such from seed on.
func blobRanked(names []string, rank int, seed uint64) content.Descriptor {
	for i := seed; ; i++ {
		if desc := descOf(randomBlob(i, 8*testChunk)); rendezvous(desc.Digest, names)[rank] == names[0] {
			return desc
		}
	}
}

// swarmAt is a swarm of the cluster of names, with a Settle of a second,
// whose clock reads *now.
func swarmAt(t *testing.T, names []string, now *time.Time) *Swarm {
	s, err := NewSwarm(clusterOf(names), nil, SwarmConfig{Settle: time.Second, Now: func() time.Time { return *now }}, nil, nil)
	require.NoError(t, err)
	return s
}

// otherShare is the chunks of a blob of that many that f, one of two
// origin fetchers, leaves to the other.
func otherShare(f *plan, chunks int) []int {
	share, _ := f.originShare()
	var theirs []int
	for i := range chunks {
		if i%2 != share {
			theirs = append(theirs, i)
		}
	}
	return theirs
}

// twoOriginFetchers is the plan of an origin fetcher of a blob of 8 chunks,
// and the view of the other fetcher, which has none yet.
func twoOriginFetchers(t *testing.T) (*plan, *peerView) {
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	other := &peerView{name: "other", known: true,
		state: PeerState{ChunkState: cache.ChunkState{Size: 8 * testChunk, ChunkSize: testChunk, Have: []byte{0}}, Origin: true}}
	f := &plan{s: s, d: descOf(randomBlob(40, testChunk)).Digest, inflight: map[int]int{},
		peers: peersOf(other), originRole: true}
	_, fetchers := f.originShare()
	require.Len(t, fetchers, 2)
	return f, other
}

// An origin fetcher keeps 3 requests in flight to the origin while its fill
// is the node's only one, 2 while the node fills other blobs too, and what
// the config says where it says a number.
func TestOriginRequestsGoByTheNodesFills(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	blob := descOf(randomBlob(41, testChunk))
	f := s.newPlan(blob, testChunk, nil)
	f.originRole, f.originShown = true, true
	requests := func() int {
		f.originInflight = 0
		for f.useOrigin() {
			f.originInflight++
		}
		return f.originInflight
	}
	require.Equal(t, 3, requests(), "the node's only fill")
	other := s.newPlan(descOf(randomBlob(42, testChunk)), testChunk, nil)
	require.Equal(t, 2, requests(), "another fill runs")
	other.release()
	other.release()
	require.Equal(t, 3, requests(), "the other ended, and counts once")
	s.cfg.OriginInFlight = 5
	require.Equal(t, 5, requests(), "as configured")
}

// Origin fetchers that see different sets of fetchers (a ban, a slow
// gossip) split the chunks differently: a chunk this node's split gives the
// other, and the other's split gives someone else, is fetched by none. A
// helper leaves the other its next chunks, but once word from it sent
// leftWait after that shows it neither has nor fetches them, it takes them.
func TestHelperTakesChunksTheOwnerDoesNotFetch(t *testing.T) {
	t.Parallel()
	f, other := twoOriginFetchers(t)
	now := time.Unix(1000, 0)
	f.s.cfg.Now = func() time.Time { return now }
	f.s.cfg.OriginInFlight = 2
	f.originTime = time.Second
	theirs := otherShare(f, 8)
	left := theirs[2:] // fewer than leaveTo: left to the other
	other.heardAt = now
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(left)), "its next chunks are left to it")

	now = now.Add(leftWait)
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(left)), "no word from it since")
	other.heardAt = now.Add(-time.Millisecond)
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(left)), "its word was sent before leftWait was up")
	other.heardAt = now
	require.Equal(t, left[1], f.nextFromOrigin(slices.Clone(left)), "it said it fetches neither: from the back")

	f.inflight[left[1]] = 1
	other.state.Fetching = setBit(nil, left[0], true)
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(left)), "it fetches the other one")
}

// One origin request stalled (the agent's CPU quota throttled it) moves
// the origin pace four times its average at most, and a real slowdown
// still shows within a few requests.
func TestOriginPaceBoundsAStall(t *testing.T) {
	t.Parallel()
	require.Equal(t, 500*time.Microsecond, originPace(0, 2*time.Millisecond), "the first request")
	pace := originPace(2*time.Millisecond, 200*time.Millisecond)
	require.Equal(t, (3*2+8)*time.Millisecond/4, pace, "a stall counts four times the average")
	for range 6 {
		pace = originPace(pace, 200*time.Millisecond)
	}
	require.Greater(t, pace, 50*time.Millisecond, "a slower origin shows")
}

// While a reader waits on the blob in order (the registry mirror's stream
// to containerd), a fetcher ahead of the other takes the other's next
// chunks from the front, past those left to it, where they come before its
// own next one: the shares interleave, and the prefix the reader follows
// moves at the slower fetcher's pace. With no reader, its own share first.
func TestFetcherAheadHelpsTheReadersPrefix(t *testing.T) {
	t.Parallel()
	f, other := twoOriginFetchers(t)
	f.s.cfg.OriginInFlight = 2 // the other's requests in flight: what a helper leaves it
	f.originTime = time.Second
	f.want = new(atomic.Int64)
	f.want.Store(0)
	share, _ := f.originShare()
	var mine []int
	for i := range 8 {
		if i%2 == share {
			mine = append(mine, i)
		}
	}
	theirs := otherShare(f, 8)
	all := []int{0, 1, 2, 3, 4, 5, 6, 7}

	require.Equal(t, mine[0], f.nextFromOrigin(slices.Clone(all)), "level with the other: its own share")
	ahead := append(slices.Clone(theirs), mine[3])
	require.Equal(t, theirs[2], f.nextFromOrigin(slices.Clone(ahead)), "ahead: the other's first chunk past the two left to it")
	other.state.Fetching = setBit(setBit(nil, theirs[0], true), theirs[1], true)
	require.Equal(t, mine[3], f.nextFromOrigin(slices.Clone(ahead)), "the other fetches its next two: none past them comes first")

	other.state.Fetching = nil
	f.want.Store(-1)
	require.Equal(t, mine[3], f.nextFromOrigin(slices.Clone(ahead)), "no reader: its own share first")
}
