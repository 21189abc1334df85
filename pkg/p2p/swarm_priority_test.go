package p2p

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// The origin is not a peer: a slow answer never counts against it, and
// failures give up the blob only after originGiveUp of them in a row and
// originPatience without a byte from it.
func TestOriginIsNotDroppedForBeingSlow(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	f := &plan{s: s, inflight: map[int]int{}, originHeard: time.Now()}
	slow := fmt.Errorf("%w: 100 of 2097152 bytes in time: %w", errSlow, context.DeadlineExceeded)
	for range 3 * originGiveUp {
		f.inflight[0]++
		f.originInflight++
		require.NoError(t, f.handle(chunkResult{chunk: 0, err: slow}), "a slow origin is asked again")
	}
	require.Zero(t, f.originFailures)
	require.False(t, f.originPause.After(time.Now()), "no pause after a slow answer")

	refused := errors.New("connection refused")
	for range 2 * originGiveUp {
		f.inflight[0]++
		f.originInflight++
		require.NoError(t, f.handle(chunkResult{chunk: 0, err: refused}), "within originPatience of its last bytes")
	}
	require.True(t, f.originPause.After(time.Now()), "failures back off")
	require.LessOrEqual(t, time.Until(f.originPause), originMaxPause)

	f.originHeard = time.Now().Add(-originPatience)
	f.inflight[0]++
	f.originInflight++
	require.ErrorContains(t, f.handle(chunkResult{chunk: 0, err: refused}), "sent nothing for")

	f.inflight[0]++
	f.originInflight++
	require.ErrorIs(t, f.handle(chunkResult{chunk: 0, err: content.Permanent(content.ErrNotFound)}), content.ErrNotFound,
		"an answer that the blob is not there ends it at once")
}

// An origin request has no deadline, only the stall watch: a registry
// whose link many pulls share sends each of them slowly, and a request cut
// at a deadline throws away what it brought, to ask for it again.
func TestOriginRequestsHaveNoDeadline(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 1, nil)
	data := randomBlob(62, 4*testChunk)
	origin := &deadlineOrigin{countingOrigin: countingOrigin{data: data}}
	require.NoError(t, nodes[0].fetch(context.Background(), data, origin))
	require.Positive(t, origin.requests.Load())
	require.Zero(t, origin.withDeadline.Load(), "origin requests with a deadline, of %d", origin.requests.Load())
}

// deadlineOrigin counts the requests whose context has a deadline.
type deadlineOrigin struct {
	countingOrigin
	requests, withDeadline atomic.Int32
}

func (o *deadlineOrigin) OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error) {
	o.requests.Add(1)
	if _, ok := ctx.Deadline(); ok {
		o.withDeadline.Add(1)
	}
	return o.countingOrigin.OpenBoundedRange(ctx, off, n)
}

// A reader's next chunks go before the rarest: from the chunk holding the
// byte it waits on, the lowest that no request is out for.
func TestWantedChunksGoFirst(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	holder := &peerView{name: "holder", known: true, chunkBusy: map[int]time.Time{},
		state: PeerState{ChunkState: cache.ChunkState{Size: 16 * testChunk, ChunkSize: testChunk, Have: []byte{0xff, 0xff}}}}
	want := new(atomic.Int64)
	want.Store(-1)
	f := &plan{s: s, want: want, maxInFlight: 4, inflight: map[int]int{}, peers: peersOf(holder)}
	missing := []int{12, 3, 9, 6, 7, 1}

	chunk, _ := f.pickWanted(missing, testChunk)
	require.Equal(t, -1, chunk, "no reader waits")
	want.Store(5*testChunk + 17)
	chunk, peer := f.pickWanted(missing, testChunk)
	require.Equal(t, 6, chunk, "the first missing chunk from the reader's byte")
	require.Same(t, holder, peer)
	f.inflight[6] = 1
	chunk, _ = f.pickWanted(missing, testChunk)
	require.Equal(t, 7, chunk, "the next, while 6 is on its way")
	f.inflight[7] = 1
	chunk, _ = f.pickWanted(missing, testChunk)
	require.Equal(t, -1, chunk, "9 is beyond maxInFlight chunks of the reader")
	s.requestCounter("holder").Store(int32(s.cfg.PerPeer))
	f.inflight[7] = 0
	chunk, _ = f.pickWanted(missing, testChunk)
	require.Equal(t, -1, chunk, "no free supplier")
}

// A blob of one small chunk skips the election: nodes that want it at
// once each take it from the origin without the origin role, and a node
// that wants it later takes it from a peer that holds it whole.
func TestSmallBlobSkipsTheElection(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 4, nil)
	data := randomBlob(60, testChunk/2)
	origin := &countingOrigin{data: data}
	require.NoError(t, fetchAll(nodes[:3], data, 20*time.Second, func(*swarmNode) content.RangeOpener { return origin }))
	for _, n := range nodes[:3] {
		require.Zero(t, testutil.ToFloat64(n.swarm.m.originRole), "%s took no origin role", n.name)
	}
	sent := origin.sent.Load()
	require.LessOrEqual(t, sent, int64(3*len(data)), "at most one copy each")

	require.Eventually(t, func() bool {
		for _, h := range nodes[3].swarm.dir.Holders(descOf(data).Digest) {
			if h.Complete {
				return true
			}
		}
		return false
	}, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, nodes[3].fetch(context.Background(), data, origin))
	require.Equal(t, sent, origin.sent.Load(), "the fourth copy came from a peer")
	require.Equal(t, float64(len(data)), testutil.ToFloat64(nodes[3].swarm.m.received.WithLabelValues("peer")))
}

// A holder that sends a small blob's wrong bytes is banned, and the blob
// comes from the origin.
func TestSmallBlobFromALyingHolder(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 2, map[int]swarmNodeOpts{0: {wrap: corruptChunks}})
	data := randomBlob(61, 1000)
	origin := &countingOrigin{data: data}
	require.NoError(t, nodes[0].fetch(context.Background(), data, origin))
	require.Eventually(t, func() bool {
		hs := nodes[1].swarm.dir.Holders(descOf(data).Digest)
		return len(hs) == 1 && hs[0].Complete
	}, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, nodes[1].fetch(context.Background(), data, origin))
	require.True(t, nodes[1].swarm.Banned("n0"))
	require.Equal(t, int64(2*len(data)), origin.sent.Load())
}
