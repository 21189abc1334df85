package p2p

import (
	"context"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"
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
				got := originRate(limit, node, tc.fetchers)
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
