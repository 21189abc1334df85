package p2p

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// On a fast link, where a chunk comes within a few Refreshes, a fill reads
// a holder's state again sooner than Refresh: every relay hop waits on
// that news. Where chunks take seconds it keeps Refresh.
func TestFastFillReadsStatesSooner(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)
	dir := clusterOf([]string{"me", "node-000"})
	s, err := NewSwarm(dir, nil, SwarmConfig{Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	readAgainAfter := func(took time.Duration) time.Duration {
		f := s.newPlan(descOf(randomBlob(2, 8*testChunk)), testChunk, nil)
		f.addPeer("node-000", now)
		pv := f.peers.get("node-000")
		for i := range 4 {
			f.book(i, pv)
			require.NoError(t, f.handle(chunkResult{chunk: i, peer: "node-000", took: took}))
		}
		pv.reading, pv.readAt = false, now
		for gap := time.Millisecond; ; gap += time.Millisecond {
			at := now.Add(gap)
			s.cfg.Now = func() time.Time { return at }
			if slices.Contains(f.refresh(nil), pv) {
				return gap
			}
		}
	}
	require.Equal(t, s.cfg.Refresh, readAgainAfter(3*time.Second), "chunks of seconds")
	fast := readAgainAfter(100 * time.Millisecond)
	require.Less(t, fast, s.cfg.Refresh/2, "a 100 ms chunk")
	require.GreaterOrEqual(t, fast, s.cfg.Refresh/10)
}

// A fill's chunk time starts at its first chunk's, not a quarter of it
// (a moving average from zero): the holdoff and the refresh follow it.
func TestFirstChunkSetsTheChunkTime(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(clusterOf([]string{"me", "node-000"}), nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	f := s.newPlan(descOf(randomBlob(3, 4*testChunk)), testChunk, nil)
	f.addPeer("node-000", time.Now())
	f.book(0, f.peers.get("node-000"))
	require.NoError(t, f.handle(chunkResult{chunk: 0, peer: "node-000", took: time.Second}))
	require.Equal(t, 1500*time.Millisecond, f.holdoff())
}
