package p2p

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
)

// gossipDir is a cluster whose gossip names holders of every blob.
type gossipDir struct {
	staticDir
	holders []Holder
}

func (d gossipDir) Holders(digest.Digest) []Holder { return d.holders }

// manyHolders is a cluster of n members besides "me", all holding the
// blob, the first complete of them complete.
func manyHolders(n, complete int) gossipDir {
	dir := gossipDir{staticDir: staticDir{local: "me", peers: map[string]Peer{}}}
	for i := range n {
		name := fmt.Sprintf("node-%03d", i)
		dir.peers[name] = Peer{Name: name, Meta: NodeMeta{ChunkAddr: "127.0.0.1:1"}}
		dir.holders = append(dir.holders, Holder{Peer: name, Complete: i < complete})
	}
	return dir
}

// A download among many holders reads the states of MaxFollowed of them:
// the first in election order, which settle the origin role, and the
// complete ones among them.
func TestFollowBoundsTheHoldersRead(t *testing.T) {
	t.Parallel()
	dir := manyHolders(200, 3)
	now := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	s, err := NewSwarm(dir, nil, SwarmConfig{MaxFollowed: 10, Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	d := digest.FromString("many holders")
	f := s.newPlan(descOf(randomBlob(1, 4*testChunk)), testChunk, nil)
	f.d = d
	reads := f.refresh([]int{0, 1, 2, 3})
	require.Equal(t, 10, f.peers.len())
	require.Len(t, reads, 10, "one state read per followed holder")
	names := []string{"me"}
	for _, h := range dir.holders {
		names = append(names, h.Peer)
	}
	for _, name := range f.electionOrder(names)[:s.cfg.OriginFetchers+1] {
		if name != "me" {
			require.Contains(t, f.peers.byName, name, "the first in election order are followed")
		}
	}
	for _, h := range dir.holders[:3] {
		require.Contains(t, f.peers.byName, h.Peer, "complete holders are followed first")
	}
	// Many downloads draw different holders: no holder is everyone's.
	drawn := map[string]bool{}
	for range 20 {
		g := s.newPlan(descOf(randomBlob(1, 4*testChunk)), testChunk, nil)
		g.d = d
		g.refresh([]int{0})
		for name := range g.peers.byName {
			drawn[name] = true
		}
	}
	require.Greater(t, len(drawn), 60, "holders are drawn at random")
}

// With as many followed as it may, a download drops the one with least of
// what it misses every rotateEvery (never a leader, an origin fetcher or
// one it has requests with), follows another, and does not take the
// dropped one back for a while.
func TestFollowRotatesTheLeastUseful(t *testing.T) {
	t.Parallel()
	dir := manyHolders(50, 0)
	now := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	s, err := NewSwarm(dir, nil, SwarmConfig{MaxFollowed: 8, Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	f := s.newPlan(descOf(randomBlob(2, 4*testChunk)), testChunk, nil)
	missing := []int{0, 1, 2, 3}
	f.refresh(missing)
	require.Equal(t, 8, f.peers.len())
	// Every follower has all the missing chunks but one, which has one
	// (useless: none), and one that is an origin fetcher with nothing yet.
	var useless, fetcher string
	for name, pv := range f.peers.byName {
		pv.known, pv.reading = true, false
		pv.state = PeerState{ChunkState: stateWith(4, 0, 1, 2, 3)}
		if slices.Contains(f.leading, name) {
			continue
		}
		switch {
		case fetcher == "":
			fetcher, pv.state = name, PeerState{ChunkState: stateWith(4), Origin: true}
		case useless == "":
			useless, pv.state = name, PeerState{ChunkState: stateWith(4)}
		}
	}
	require.NotEmpty(t, useless)
	now = now.Add(time.Second)
	f.refresh(missing)
	require.Contains(t, f.peers.byName, useless, "not before rotateEvery")
	now = now.Add(rotateEvery)
	f.refresh(missing)
	require.NotContains(t, f.peers.byName, useless, "the least useful is dropped")
	require.Contains(t, f.peers.byName, fetcher, "an origin fetcher is kept")
	require.Equal(t, 8, f.peers.len(), "another takes its place")
	now = now.Add(s.cfg.Refresh)
	f.peers.remove(f.peers.get(fetcher).name)
	for f.peers.len() < 8 {
		f.follow(now, missing) // draws until full, never the dropped one
		now = now.Add(s.cfg.Refresh)
	}
	require.NotContains(t, f.peers.byName, useless, "not followed again at once")
}

// The origin role goes by rank among every holder gossip names, not only
// among the followed ones: a node ranked tenth waits for its turn even if
// it follows none of the nine above it.
func TestOriginRankAmongAllHolders(t *testing.T) {
	t.Parallel()
	dir := manyHolders(40, 0)
	start := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	now := start
	s, err := NewSwarm(dir, nil, SwarmConfig{Settle: time.Second, Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	names := []string{"me"}
	for _, h := range dir.holders {
		names = append(names, h.Peer)
	}
	var d digest.Digest
	for i := 0; ; i++ {
		d = digest.FromString(fmt.Sprint("rank ", i))
		if slices.Index(rendezvous(d, names), "me") == 9 {
			break
		}
	}
	f := &plan{s: s, d: d, start: start, maxInFlight: 8, holders: names[1:]}
	now = start.Add(2 * time.Second)
	f.decideOrigin()
	require.False(t, f.originRole, "nine holders rank above it")
	now = start.Add(9*time.Second - 1)
	f.decideOrigin()
	require.False(t, f.originRole, "one Settle per rank above the second")
	now = start.Add(9 * time.Second)
	f.decideOrigin()
	require.True(t, f.originRole, "its turn came, and no fetcher showed up")
}

// stateWith is the chunk state of a blob of n test chunks holding have.
func stateWith(n int, have ...int) cache.ChunkState {
	st := cache.ChunkState{Size: int64(n) * testChunk, ChunkSize: testChunk, Have: make([]byte, (n+7)/8)}
	for _, i := range have {
		st.Have[i/8] |= 1 << (i % 8)
	}
	return st
}

// Once a node saw OriginFetchers others take the origin role, it follows
// them as any holder (and drops them when they have least of what it
// misses); when one of them leaves, the election is open again and the
// first in election order are followed again.
func TestSettledOriginRoleFreesTheFetchers(t *testing.T) {
	t.Parallel()
	dir := manyHolders(50, 0)
	start := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	now := start
	s, err := NewSwarm(dir, nil, SwarmConfig{MaxFollowed: 8, Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	f := s.newPlan(descOf(randomBlob(3, 4*testChunk)), testChunk, nil)
	missing := []int{0, 1, 2, 3}
	f.refresh(missing)
	fetchers := slices.DeleteFunc(slices.Clone(f.leading), func(n string) bool { return n == "me" })[:2]
	for name, pv := range f.peers.byName {
		pv.known, pv.reading = true, false
		pv.state = PeerState{ChunkState: stateWith(4, 0, 1, 2, 3)}
		if slices.Contains(fetchers, name) {
			pv.state = PeerState{ChunkState: stateWith(4), Origin: true}
		}
	}
	f.decideOrigin()
	require.False(t, f.originRole)
	require.ElementsMatch(t, fetchers, f.settledOn, "settled on the two fetchers")
	for range 2 {
		now = now.Add(rotateEvery)
		f.refresh(missing)
	}
	for _, name := range fetchers {
		require.NotContains(t, f.peers.byName, name, "a settled node drops fetchers that have least of what it misses")
	}

	delete(dir.peers, fetchers[0]) // it left the cluster
	f.decideOrigin()
	require.Nil(t, f.settledOn, "the election is open again")
	now = now.Add(s.cfg.Refresh)
	f.refresh(missing)
	require.Contains(t, f.peers.byName, fetchers[1], "the first in election order are followed again")
}

// Once settled among many holders, a download keeps following the origin
// fetchers only by the chance it would have drawn them: they keep about
// MaxFollowed followers, not every node. The role is often settled before
// gossip names the holders (the first-ranked members are asked directly).
func TestSettledFetchersKeepAboutMaxFollowedFollowers(t *testing.T) {
	t.Parallel()
	dir := manyHolders(50, 0)
	s, err := NewSwarm(dir, nil, SwarmConfig{MaxFollowed: 8}, nil, nil)
	require.NoError(t, err)
	kept := 0
	for i := range 200 {
		f := s.newPlan(descOf(randomBlob(uint64(i), testChunk)), testChunk, nil)
		f.settle([]string{"node-001", "node-002"}) // before gossip named the holders
		for _, h := range dir.holders {
			f.holders = append(f.holders, h.Peer)
		}
		if !f.dropsFetchers() {
			kept++
		}
	}
	require.InDelta(t, 200*8/50, kept, 20, "about MaxFollowed/holders of the downloads keep the fetchers")
}
