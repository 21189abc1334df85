package swarmsim

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A small cluster, faults and all, fills the blob: every node that was not
// killed holds it, and the origin sent at least one copy.
func TestSmallClusterFillsTheBlob(t *testing.T) {
	t.Parallel()
	for _, faults := range []bool{false, true} {
		cfg := Config{Nodes: 20, Size: 64 << 20, ChunkSize: 2 << 20, Link: 1e9 / 8, Seed: 3}
		if faults {
			cfg.SlowFraction, cfg.KillFraction, cfg.LateFraction, cfg.Liars = 0.1, 0.1, 0.1, 1
		}
		r, err := Run(cfg)
		require.NoError(t, err)
		require.Equal(t, cfg.Nodes, r.Finished+r.Killed, "faults %v", faults)
		require.GreaterOrEqual(t, r.OriginRatio, 1-1e-9, "faults %v", faults)
		require.Positive(t, r.StateBytesPerNodeS)
		if faults {
			require.Equal(t, 2, r.Killed)
		}
	}
}

// bench/gossip's figures at 100 members.
const measured100P50Ms, measured100P99Ms = 352, 689

// The gossip model: delays rise with u and, in the median, with N; at
// 100 members its quantiles are the measurement's; events cost bytes, and
// more per node the larger the cluster.
func TestGossipModel(t *testing.T) {
	t.Parallel()
	prev := time.Duration(-1)
	for u := 0.0; u < 1; u += 0.001 {
		d := gossipDelay(100, u)
		require.GreaterOrEqual(t, d, prev, "u %v", u)
		prev = d
	}
	require.Less(t, gossipDelay(30, 0.5), gossipDelay(100, 0.5))
	require.Less(t, gossipDelay(100, 0.5), gossipDelay(1000, 0.5))
	assert.InDelta(t, measured100P50Ms, gossipDelay(100, 0.5).Seconds()*1000, 0.1*measured100P50Ms)
	assert.InDelta(t, measured100P99Ms, gossipDelay(100, 0.99).Seconds()*1000, 0.1*measured100P99Ms)

	idle := gossipBytes(100, 0, 60)
	require.Positive(t, idle)
	require.Greater(t, gossipBytes(100, 200, 60), idle)
	require.Greater(t, gossipBytes(1000, 2000, 60)-gossipBytes(1000, 0, 60), gossipBytes(100, 200, 60)-idle)
}
