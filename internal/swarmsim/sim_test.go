package swarmsim

import (
	"testing"

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
