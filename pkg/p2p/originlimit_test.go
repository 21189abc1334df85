package p2p

import (
	"context"
	"sync/atomic"
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
// of the origin limit, which follows the fetchers its fills see: the
// limiter's bucket holds what was read less its refill (two bytes a second
// here, and one while it shares the limit with a second fetcher).
func TestOriginLimitPacesOriginReads(t *testing.T) {
	t.Parallel()
	const n = 256 << 10
	blob := randomBlob(19, n)
	d := descOf(blob).Digest
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{OriginLimit: 2}, nil, nil)
	require.NoError(t, err)
	require.Equal(t, rate.Limit(2), s.originPace.Limit(), "alone: the whole limit")

	s.seeFetchers(d, []string{"me", "b"})
	require.Equal(t, rate.Limit(1), s.originPace.Limit(), "half of it, with one more fetcher of the blob")
	burst := float64(s.originPace.Burst())
	require.Greater(t, burst, float64(n), "the read fits the bucket: nothing waits")
	c := newLiveChunk(n)
	require.NoError(t, s.fetchOrigin(context.Background(), memOrigin(blob), 0, c))
	require.Equal(t, blob, c.data())
	require.InDelta(t, burst-n, s.originPace.Tokens(), 30, "the read took its bytes from the limit")

	s.seeFetchers(d, nil)
	require.Equal(t, rate.Limit(2), s.originPace.Limit(), "the fill ended: alone again")
}

// Disjoint sets of nodes fetching different blobs: each node's fills see
// only their own blob's fetchers, but gossip tells every node how many
// blobs each member fetches from the origin, and the parts are reckoned
// over all of them. The node publishes its own count as it changes.
func TestOriginLimitCountsTheClustersFetches(t *testing.T) {
	t.Parallel()
	x, y := digest.FromString("x"), digest.FromString("y")
	dir := staticDir{local: "me", peers: map[string]Peer{
		"b": {Name: "b", Meta: NodeMeta{OriginFetches: 1}}, // x's other fetcher
		"c": {Name: "c", Meta: NodeMeta{OriginFetches: 1}}, // fetchers of other blobs
		"d": {Name: "d", Meta: NodeMeta{OriginFetches: 2}},
		"e": {Name: "e"},
	}}
	var published []int
	s, err := NewSwarm(dir, nil, SwarmConfig{OriginLimit: 1200, PublishOriginFetches: func(n int) { published = append(published, n) }}, nil, nil)
	require.NoError(t, err)

	s.seeFetchers(x, []string{"me", "b"})
	require.Equal(t, rate.Limit(1200/5), s.originPace.Limit(), "one of the cluster's five (blob, fetcher) pairs")
	s.seeFetchers(y, []string{"me", "d"})
	require.Equal(t, rate.Limit(1200*2/6), s.originPace.Limit(), "two of six: its own second counts at once")
	s.seeFetchers(y, nil)
	s.seeFetchers(x, []string{"b"})
	require.Equal(t, rate.Limit(1200/5), s.originPace.Limit(), "no longer a fetcher, a reader of the origin: one more pair")
	require.Equal(t, []int{1, 2, 1, 0}, published, "its own count, as it changed")

	// A member claiming more than a node fetches counts as maxCountedFetches.
	dir.peers["liar"] = Peer{Name: "liar", Meta: NodeMeta{OriginFetches: maxOriginFetches}}
	s, err = NewSwarm(dir, nil, SwarmConfig{OriginLimit: 1200}, nil, nil)
	require.NoError(t, err)
	s.seeFetchers(x, []string{"me", "b"})
	require.InDelta(t, 1200.0/(5+maxCountedFetches), float64(s.originPace.Limit()), 1e-9)
}

// Two pairs of nodes fill two different blobs from one origin, each pair
// seeing only its own blob's fetchers; with the counts gossiped, the four
// fetchers share the cluster's limit. The origin's bytes stay within the
// limit over the time taken, the limiters' bursts, and a second of the
// limit for the counts to cross gossip (a slower machine only takes
// longer); with each pair taking the whole limit, they were about twice
// that.
func TestOriginLimitHoldsAcrossDisjointFills(t *testing.T) {
	t.Parallel()
	const limit = 4 << 20
	opts := map[int]swarmNodeOpts{}
	for i := range 4 {
		opts[i] = swarmNodeOpts{originLimit: limit}
	}
	nodes := startSwarmCluster(t, 4, opts)
	x, y := randomBlob(31, 192*testChunk), randomBlob(32, 192*testChunk)
	var sent atomic.Int64
	ox, oy := &countingOrigin{data: x}, &countingOrigin{data: y}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	for i, n := range nodes {
		data, origin := x, ox
		if i >= 2 {
			data, origin = y, oy
		}
		g.Go(func() error { return n.fetch(ctx, data, origin) })
	}
	require.NoError(t, g.Wait())
	took := time.Since(start).Seconds()
	sent.Add(ox.sent.Load() + oy.sent.Load())
	bursts := float64(4 * nodes[0].swarm.originPace.Burst())
	t.Logf("origin sent %d bytes in %.2fs: %.0f%% of the limit", sent.Load(), took, 100*float64(sent.Load())/(limit*took))
	require.LessOrEqual(t, float64(sent.Load()), limit*(took+1)+bursts)
}
