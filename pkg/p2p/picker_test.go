package p2p

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
)

// A holder serves one requester PerPeer chunks at once and refuses more:
// the fills of an image's layers share that allowance, so one fill's
// requests to a peer keep the others from asking it too.
func TestPerPeerRequestsAcrossFills(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	holder := &peerView{name: "holder", known: true,
		state: PeerState{ChunkState: cache.ChunkState{Size: 4 * testChunk, ChunkSize: testChunk, Have: []byte{0b1111}}}}
	layer2 := &plan{s: s, inflight: map[int]int{}, asked: map[int][]string{}, peers: peersOf(holder)}
	now := time.Now()
	pick, _ := layer2.supplierOf(0, false, now)
	require.NotNil(t, pick, "the holder is free")

	s.requestCounter("holder").Add(int32(s.cfg.PerPeer))
	pick, _ = layer2.supplierOf(0, false, now)
	require.Nil(t, pick, "layer 1's requests take the holder's allowance for this node")
	s.requestCounter("holder").Add(-1)
	pick, _ = layer2.supplierOf(0, false, now)
	require.NotNil(t, pick, "one of layer 1's requests ended")
}

// An origin fetcher is asked for a chunk it already sent only when no
// other holder of it is free, and, when it is the only holder, once its
// receiver has had time to pass the chunk on.
func TestOriginFetcherIsAskedForSentChunksLast(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	state := func(have byte, sent byte, origin bool) PeerState {
		return PeerState{ChunkState: cache.ChunkState{Size: 3 * testChunk, ChunkSize: testChunk, Have: []byte{have}}, Sent: []byte{sent}, Origin: origin}
	}
	now := time.Now()
	fetcher := &peerView{name: "fetcher", known: true, state: state(0b011, 0b001, true), sentSeen: map[int]time.Time{0: now}}
	other := &peerView{name: "other", known: true, state: state(0b001, 0, false)}
	f := &plan{s: s, inflight: map[int]int{}, peers: peersOf(fetcher, other)}

	chunk, peer := f.pickFromPeers([]int{0, 1}, false)
	require.Equal(t, 1, chunk, "the unsent chunk")
	require.Same(t, fetcher, peer)
	chunk, peer = f.pickFromPeers([]int{0}, false)
	require.Equal(t, 0, chunk)
	require.Same(t, other, peer, "the other holder, not the fetcher's upload")

	s.requestCounter("other").Store(int32(s.cfg.PerPeer))
	chunk, peer = f.pickFromPeers([]int{0}, false)
	require.Equal(t, 0, chunk)
	require.Same(t, fetcher, peer, "no other holder is free: the fetcher, which sends a repeat when its upload has room")

	f.peers.remove("other")
	chunk, _ = f.pickFromPeers([]int{0}, false)
	require.Equal(t, -1, chunk, "its receiver passes chunk 0 on soon")
	fetcher.sentSeen[0] = now.Add(-f.holdoff())
	chunk, peer = f.pickFromPeers([]int{0}, false)
	require.Equal(t, 0, chunk, "the receiver had time to pass it on, and did not")
	require.Same(t, fetcher, peer)
}

// A holder of the whole blob is asked for a chunk only when no holder
// still filling it has or receives it and is free, but for the endgame:
// its upload then goes to the chunks no other node has (one node pulled an
// image, and the others all read it in the same order).
func TestWholeBlobHolderIsAskedLast(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	state := func(have byte, complete bool) PeerState {
		return PeerState{ChunkState: cache.ChunkState{Size: 3 * testChunk, ChunkSize: testChunk, Have: []byte{have}, Complete: complete}}
	}
	whole := &peerView{name: "whole", known: true, state: state(0b111, true)}
	filling := &peerView{name: "filling", known: true, state: state(0b001, false)}
	receiving := &peerView{name: "receiving", known: true, state: state(0, false)}
	receiving.state.Fetching = []byte{0b010}
	f := &plan{s: s, inflight: map[int]int{}, peers: peersOf(whole, filling, receiving)}
	now := time.Now()
	for i, want := range []*peerView{filling, receiving, whole} {
		pick, count := f.supplierOf(i, false, now)
		require.Same(t, want, pick, "chunk %d", i)
		require.Equal(t, []int{2, 2, 1}[i], count, "chunk %d: its holders", i)
	}
	s.requestCounter("filling").Store(int32(s.cfg.PerPeer))
	pick, _ := f.supplierOf(0, false, now)
	require.Same(t, whole, pick, "the other holder is not free")
	s.requestCounter("filling").Store(1)
	pick, _ = f.supplierOf(0, true, now)
	require.Same(t, whole, pick, "the endgame takes the least loaded holder")
}

// Of chunks equally rare, a blob read in order takes the first: its only
// holder's upload then brings them in about in order, and the reader's
// prefix follows the fill. Else any, so nodes spread over them.
func TestEquallyRareChunksInOrderForAReader(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	holder := &peerView{name: "holder", known: true,
		state: PeerState{ChunkState: cache.ChunkState{Size: 64 * testChunk, ChunkSize: testChunk, Have: bytes.Repeat([]byte{0xff}, 8), Complete: true}}}
	want := new(atomic.Int64)
	want.Store(-1)
	f := &plan{s: s, chunkSize: testChunk, want: want, inflight: map[int]int{}, peers: peersOf(holder)}
	missing := func() []int {
		m := make([]int, 0, 60)
		for i := 4; i < 64; i++ {
			m = append(m, i)
		}
		rand.Shuffle(len(m), func(i, j int) { m[i], m[j] = m[j], m[i] })
		return m
	}
	firsts := map[int]bool{}
	for range 20 {
		chunk, _ := f.pickFromPeers(missing(), false)
		firsts[chunk] = true
	}
	require.Greater(t, len(firsts), 1, "no reader: any of them")
	want.Store(0)
	for range 20 {
		chunk, peer := f.pickFromPeers(missing(), false)
		require.Equal(t, 4, chunk, "a reader waits: the first missing")
		require.Same(t, holder, peer)
	}
}

// The chunk buffers of a node's downloads together stay within
// bufferBytes: a download alone keeps MaxInFlight chunks in flight, one
// that starts when the others hold every buffer keeps two, and buffers
// given back (a fill's end) go to those that wait.
func TestChunkBuffersBoundAllDownloads(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{PerPeer: 1000}, nil, nil)
	require.NoError(t, err)
	const chunk, chunks = 16 << 20, 64
	have := make([]byte, chunks/8)
	for i := range have {
		have[i] = 0xff
	}
	fill := func(i int) (*plan, []request) {
		desc := descOf(randomBlob(uint64(200+i), testChunk))
		desc.Size = chunks * chunk
		f := s.newPlan(desc, chunk, nil)
		f.peers.add(&peerView{name: "holder", known: true, chunkBusy: map[int]time.Time{}, sentSeen: map[int]time.Time{},
			state: PeerState{ChunkState: cache.ChunkState{Size: desc.Size, ChunkSize: chunk, Have: have}}})
		missing := make([]int, chunks)
		for i := range missing {
			missing[i] = i
		}
		return f, f.schedule(missing)
	}
	var fills []*plan
	for i := range bufferBytes / maxInFlightBytes {
		f, reqs := fill(i)
		require.Len(t, reqs, maxInFlightBytes/chunk, "fill %d: its own bound", i)
		fills = append(fills, f)
	}
	late, reqs := fill(99)
	require.Len(t, reqs, 2, "the buffers are taken: two requests still")
	require.EqualValues(t, bufferBytes+2*chunk, s.buffered.Load())

	fills[0].release()
	missing := []int{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}
	require.Len(t, late.schedule(missing), maxInFlightBytes/chunk-2, "a fill's end gave its buffers back")
	for _, f := range append(fills[1:], late) {
		f.release()
	}
	require.Zero(t, s.buffered.Load())
}

// peersOf is a peer set of pvs, followed in that order.
func peersOf(pvs ...*peerView) (s peerSet) {
	for _, pv := range pvs {
		s.add(pv)
	}
	return s
}

// An endgame duplicate goes to a peer other than those its chunk is in
// flight from: when the first request fails and the duplicate is the one
// left, the next duplicate must not go to the duplicate's peer (seen in the
// simulation: a node's original and duplicate both read one slow relay,
// and nothing else was asked for 45 s).
func TestEndgameDuplicateAvoidsThePeersInFlight(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	a, b, c := chunkHolder("a", 2, 0b01), chunkHolder("b", 2, 0b01), chunkHolder("c", 2, 0b01)
	c.state.Sent = []byte{0b01} // b is nearer (supplyRank): c passed chunk 0 on already
	f := &plan{s: s, maxInFlight: 8, inflight: map[int]int{}, asked: map[int][]string{}, peers: peersOf(a, b, c)}
	f.book(0, a)
	f.book(0, b) // the endgame duplicate
	require.NoError(t, f.handle(chunkResult{chunk: 0, peer: "a", err: errNotHeld}))
	for range 20 { // the peers are walked from a random start
		_, peer := f.pickFromPeers([]int{0}, true)
		require.NotNil(t, peer)
		require.Equal(t, "c", peer.name, "chunk 0 is in flight from b already")
	}
}

// A copy that comes too slowly may be given up maxGiveUps times per chunk,
// and never an origin fetcher's: the origin paces it. The next copy is
// waited for, so a chunk whose every source is slow still comes.
func TestSlowCopyIsGivenUpAFewTimesPerChunk(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	peer := func(name string, origin bool) *peerView {
		return &peerView{name: name, known: true, state: PeerState{Origin: origin,
			ChunkState: cache.ChunkState{Size: 2 * testChunk, ChunkSize: testChunk, Have: []byte{0b11}}}}
	}
	holder, fetcher := peer("holder", false), peer("fetcher", true)
	f := &plan{s: s, maxInFlight: 8, inflight: map[int]int{}, asked: map[int][]string{}, peers: peersOf(holder, fetcher)}
	require.False(t, f.book(0, fetcher).slowEnds, "the origin paces a fetcher's copy")
	for range maxGiveUps {
		require.True(t, f.book(0, holder).slowEnds)
		require.NoError(t, f.handle(chunkResult{chunk: 0, peer: "holder", err: fmt.Errorf("%w: too slow", errSlow)}))
	}
	require.False(t, f.book(0, holder).slowEnds, "chunk 0 was given up enough")
	require.True(t, f.book(1, holder).slowEnds)
}

// While a node fills several blobs at once (an image's layers), no copy is
// given up as slow: its downlink is shared among all their copies, so slow
// copies are the norm, and one given up throws its bytes away to fetch them
// again over the same full link. With the other fills done, the rule is back.
func TestNoCopyIsGivenUpWhileSeveralBlobsFill(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	holder := chunkHolder("holder", 2, 0b11)
	f := &plan{s: s, maxInFlight: 8, inflight: map[int]int{}, asked: map[int][]string{}, peers: peersOf(holder)}
	s.fills.Store(4)
	require.False(t, f.book(0, holder).slowEnds, "four fills at once")
	s.fills.Store(1)
	require.True(t, f.book(1, holder).slowEnds, "this fill alone")
}

// While a node fills several blobs at once, no endgame duplicate is asked:
// the node's downlink carries the other fills' chunks, and a duplicate
// takes its bytes from them. The last fill running has its endgame.
func TestNoEndgameWhileSeveralBlobsFill(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	a, b := chunkHolder("a", 1, 0b1), chunkHolder("b", 1, 0b1)
	f := &plan{s: s, maxInFlight: 8, inflight: map[int]int{}, asked: map[int][]string{}, peers: peersOf(a, b)}
	f.book(0, a)
	s.fills.Store(4)
	chunk, _ := f.pickFromPeers([]int{0}, true)
	require.Equal(t, -1, chunk, "four fills at once")
	s.fills.Store(1)
	chunk, peer := f.pickFromPeers([]int{0}, true)
	require.Equal(t, 0, chunk, "this fill alone")
	require.Equal(t, "b", peer.name)
}

// chunkHolder is a known peer of a blob of chunks chunks of testChunk
// bytes, holding those whose bits are set in have.
func chunkHolder(name string, chunks int64, have byte) *peerView {
	return &peerView{name: name, known: true,
		state: PeerState{ChunkState: cache.ChunkState{Size: chunks * testChunk, ChunkSize: testChunk, Have: []byte{have}}}}
}
