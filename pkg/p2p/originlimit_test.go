package p2p

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"
)

// The origin limit is split evenly among the (blob, origin fetcher) pairs
// a node's fills see; the node takes its own pairs' parts. Where every
// node sees the same pairs, the parts add up to the limit.
func TestOriginRate(t *testing.T) {
	t.Parallel()
	x, y, z := digest.FromString("x"), digest.FromString("y"), digest.FromString("z")
	const limit = 1200
	for name, tc := range map[string]struct {
		fetchers map[digest.Digest][]string
		want     map[string]rate.Limit // node → its part
		all      bool                  // want names every fetcher: the parts add up to the limit
	}{
		"alone": {fetchers: map[digest.Digest][]string{}, want: map[string]rate.Limit{"me": limit}},
		"one blob, two fetchers": {
			fetchers: map[digest.Digest][]string{x: {"me", "b"}},
			want:     map[string]rate.Limit{"me": limit / 2, "b": limit / 2}, all: true,
		},
		"one blob, three fetchers": {
			fetchers: map[digest.Digest][]string{x: {"me", "b", "c"}},
			want:     map[string]rate.Limit{"me": limit / 3, "b": limit / 3, "c": limit / 3}, all: true,
		},
		"three blobs, one fetcher with two of them": {
			fetchers: map[digest.Digest][]string{x: {"me", "b"}, y: {"me", "c"}, z: {"b", "c"}},
			want:     map[string]rate.Limit{"me": limit / 3, "b": limit / 3, "c": limit / 3}, all: true,
		},
		"uneven: the fetcher of more blobs takes more": {
			fetchers: map[digest.Digest][]string{x: {"me", "b"}, y: {"me", "c"}},
			want:     map[string]rate.Limit{"me": limit / 2, "b": limit / 4, "c": limit / 4}, all: true,
		},
		"a reader that fetches nothing for the cluster counts as one more pair": {
			fetchers: map[digest.Digest][]string{x: {"b", "c"}},
			want:     map[string]rate.Limit{"me": limit / 3},
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var sum rate.Limit
			for node, want := range tc.want {
				mine, all := pairs(node, tc.fetchers)
				got := originRate(limit, mine, all, 0)
				require.InDelta(t, float64(want), float64(got), 1e-9, node)
				sum += got
			}
			if tc.all {
				require.InDelta(t, float64(limit), float64(sum), 1e-9, "the fetchers' parts add up to the limit")
			}
		})
	}
}

// An origin fetcher's reads from the origin take their bytes from its part
// of the origin's limit, which follows the fetchers its fills see: the
// limiter's bucket holds what was read less its refill (two bytes a second
// here, and one while it shares the limit with a second fetcher).
func TestOriginLimitPacesOriginReads(t *testing.T) {
	t.Parallel()
	const n = 256 << 10
	blob := randomBlob(19, n)
	d := descOf(blob).Digest
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{OriginLimit: 2}, nil, nil)
	require.NoError(t, err)
	pace := s.originPace("hf")
	require.Equal(t, rate.Limit(2), pace.Limit(), "alone: the whole limit")

	s.seeFetchers("hf", d, []string{"me", "b"})
	require.Equal(t, rate.Limit(1), pace.Limit(), "half of it, with one more fetcher of the blob")
	burst := float64(pace.Burst())
	require.Greater(t, burst, float64(n), "the read fits the bucket: nothing waits")
	c := newLiveChunk(n)
	require.NoError(t, s.fetchOrigin(context.Background(), Origin{Name: "hf", RangeOpener: memOrigin(blob)}, 0, c))
	require.Equal(t, blob, c.data())
	require.InDelta(t, burst-n, pace.Tokens(), 30, "the read took its bytes from the limit")
	require.Equal(t, burst, s.originPace("s3").Tokens(), "another origin's limit is its own")

	s.seeFetchers("hf", d, nil)
	require.Equal(t, rate.Limit(2), pace.Limit(), "the fill ended: alone again")
}

// Disjoint sets of nodes fetching different blobs: each node's fills see
// only their own blob's fetchers, but gossip tells every node how many
// blobs each member fetches from each origin, and the parts of an origin's
// limit are reckoned over all of that origin's. The node publishes its
// own counts as they change.
func TestOriginLimitCountsTheClustersFetches(t *testing.T) {
	t.Parallel()
	x, y := digest.FromString("x"), digest.FromString("y")
	hf, reg := OriginKeyOf("hf"), OriginKeyOf("registry.example")
	dir := staticDir{local: "me", peers: map[string]Peer{
		"b": {Name: "b", Meta: NodeMeta{OriginFetches: map[OriginKey]int{hf: 1}}}, // x's other fetcher
		"c": {Name: "c", Meta: NodeMeta{OriginFetches: map[OriginKey]int{hf: 1}}}, // fetchers of other blobs
		"d": {Name: "d", Meta: NodeMeta{OriginFetches: map[OriginKey]int{hf: 2, reg: 9}}},
		"e": {Name: "e"},
	}}
	var published []map[OriginKey]int
	s, err := NewSwarm(dir, nil, SwarmConfig{OriginLimit: 1200, PublishOriginFetches: func(counts map[OriginKey]int) { published = append(published, counts) }}, nil, nil)
	require.NoError(t, err)
	pace := s.originPace("hf")

	s.seeFetchers("hf", x, []string{"me", "b"})
	require.Equal(t, rate.Limit(1200/5), pace.Limit(), "one of the hub's five (blob, fetcher) pairs; the registry's are not the hub's")
	s.seeFetchers("hf", y, []string{"me", "d"})
	require.Equal(t, rate.Limit(1200*2/6), pace.Limit(), "two of six: its own second counts at once")
	s.seeFetchers("hf", y, nil)
	s.seeFetchers("hf", x, []string{"b"})
	require.Equal(t, rate.Limit(1200/5), pace.Limit(), "no longer a fetcher, a reader of the origin: one more pair")
	require.Equal(t, []map[OriginKey]int{{hf: 1}, {hf: 2}, {hf: 1}, {}}, published, "its own counts, as they changed")
	require.Equal(t, rate.Limit(1200/10), s.originPace("registry.example").Limit(), "the registry's nine pairs, and a reader")

	// A member claiming more than a node fetches counts as maxCountedFetches.
	dir.peers["liar"] = Peer{Name: "liar", Meta: NodeMeta{OriginFetches: map[OriginKey]int{hf: 1 << 20}}}
	s, err = NewSwarm(dir, nil, SwarmConfig{OriginLimit: 1200}, nil, nil)
	require.NoError(t, err)
	s.seeFetchers("hf", x, []string{"me", "b"})
	require.InDelta(t, 1200.0/(5+maxCountedFetches), float64(s.originPace("hf").Limit()), 1e-9)

	// A member's fetches of origins it does not name (past those its
	// metadata holds, or all of an older agent's) count against each.
	delete(dir.peers, "liar")
	dir.peers["old"] = Peer{Name: "old", Meta: NodeMeta{OriginFetches: map[OriginKey]int{otherOrigins: 3}}}
	s, err = NewSwarm(dir, nil, SwarmConfig{OriginLimit: 1200}, nil, nil)
	require.NoError(t, err)
	s.seeFetchers("hf", x, []string{"me", "b"})
	require.Equal(t, rate.Limit(1200/8), s.originPace("hf").Limit())
}

// Each origin has its own limit: OriginLimits overrides OriginLimit for
// the origins it names, 0 lifting it. A node's counts gossip the origins
// it fetches most from, as many as node metadata carries, and origins
// past what a node paces apart share one limit.
func TestOriginLimitsPerOrigin(t *testing.T) {
	t.Parallel()
	x, y := digest.FromString("x"), digest.FromString("y")
	var published map[OriginKey]int
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{OriginLimit: 1200,
		OriginLimits:         map[string]int64{"registry.example": 300, "s3": 0},
		PublishOriginFetches: func(counts map[OriginKey]int) { published = counts }}, nil, nil)
	require.NoError(t, err)
	s.seeFetchers("hf", x, []string{"me", "b"})
	s.seeFetchers("registry.example", y, []string{"me", "c", "d"})
	require.Equal(t, rate.Limit(600), s.originPace("hf").Limit())
	require.Equal(t, rate.Limit(100), s.originPace("registry.example").Limit())
	require.Nil(t, s.originPace("s3"), "no limit")
	s.seeFetchers("s3", x, []string{"me", "b"})
	require.Equal(t, map[OriginKey]int{OriginKeyOf("hf"): 1, OriginKeyOf("registry.example"): 1}, published)

	for i := range maxOriginParts {
		s.originPace(fmt.Sprint("r", i))
	}
	past := s.originPace("r-past")
	require.Same(t, past, s.originPace("r-past-2"), "origins past the bound share one limit")
	require.NotSame(t, past, s.originPace("hf"))
	require.Equal(t, rate.Limit(1200), past.Limit())
	require.Equal(t, rate.Limit(100), s.originPace("registry.example").Limit(), "a named origin keeps its own")

	counts := map[OriginKey]int{}
	for i := range maxMetaOrigins + 2 {
		counts[OriginKey(1+i)] = 10 + i
	}
	counts[OriginKey(99)] = maxCountedFetches + 5
	got := gossipedFetches(counts)
	require.Len(t, got, maxMetaOrigins)
	require.Equal(t, maxCountedFetches, got[99], "capped")
	for k := range OriginKey(4) {
		require.NotContains(t, got, 1+k, "the least fetched left out")
	}
	require.Equal(t, 10+11+12+13, got[otherOrigins], "and counted under no name: against every origin")
	_, err = encodeMeta(NodeMeta{OriginFetches: got})
	require.NoError(t, err, "fits node metadata")
	for k := range OriginKey(3) {
		delete(counts, 1+k)
	}
	require.NotContains(t, gossipedFetches(counts), otherOrigins, "as many origins as fit: each by its name")
	require.NotEqual(t, otherOrigins, OriginKeyOf(""), "no name's key is the others'")
}

// Two pairs of nodes fill two different blobs from two origins of
// different limits, each pair seeing only its own blob's fetchers; with
// the counts gossiped, each origin's fetchers share its limit. Each
// origin's bytes stay within its limit over the time its pair took, the
// limiters' bursts, and a second of the limit for the counts to cross
// gossip (a slower machine only takes longer).
func TestOriginLimitHoldsAcrossDisjointFills(t *testing.T) {
	t.Parallel()
	limits := map[string]int64{"a": 4 << 20, "b": 2 << 20}
	opts := map[int]swarmNodeOpts{}
	for i := range 4 {
		opts[i] = swarmNodeOpts{originLimit: limits["a"], originLimits: map[string]int64{"b": limits["b"]}}
	}
	nodes := startSwarmCluster(t, 4, opts)
	blobs := map[string][]byte{"a": randomBlob(31, 192*testChunk), "b": randomBlob(32, 96*testChunk)}
	origins := map[string]*countingOrigin{"a": {data: blobs["a"]}, "b": {data: blobs["b"]}}
	took := map[string]time.Duration{}
	var mu sync.Mutex
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	for i, n := range nodes {
		name := "a"
		if i >= 2 {
			name = "b"
		}
		g.Go(func() error {
			err := n.fetchFrom(ctx, blobs[name], Origin{Name: name, RangeOpener: origins[name]})
			mu.Lock()
			took[name] = max(took[name], time.Since(start))
			mu.Unlock()
			return err
		})
	}
	require.NoError(t, g.Wait())
	for name, limit := range limits {
		sent, secs := origins[name].sent.Load(), took[name].Seconds()
		bursts := float64(4 * nodes[0].swarm.originPace(name).Burst())
		t.Logf("origin %s sent %d bytes in %.2fs: %.0f%% of its limit", name, sent, secs, 100*float64(sent)/(float64(limit)*secs))
		require.LessOrEqual(t, float64(sent), float64(limit)*(secs+1)+bursts, name)
	}
}
