package p2p

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

// testClock is a settable clock for a Router.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *testClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func newTestRouter(ttl time.Duration) (*Router, *testClock) {
	r := NewRouter(ttl)
	c := &testClock{t: time.Unix(1_700_000_000, 0)}
	r.now = c.now
	return r, c
}

func ev(peer string, kind EventKind, seq uint64, d digest.Digest) holdingEvent {
	return holdingEvent{Node: peer, holding: holding{Kind: kind, Seq: seq, Digest: d}}
}

// holderList renders holders as "peer:complete" or "peer:partial", in order.
func holderList(hs []Holder) []string {
	out := make([]string, 0, len(hs))
	for _, h := range hs {
		kind := "partial"
		if h.Complete {
			kind = "complete"
		}
		out = append(out, h.Peer+":"+kind)
	}
	return out
}

func TestRouterHoldersOrder(t *testing.T) {
	t.Parallel()
	r, clock := newTestRouter(time.Minute)
	d, other := testDigest(1), testDigest(2)
	assert.Empty(t, r.Holders(d))
	for _, e := range []holdingEvent{
		ev("c", EventPartial, 1, d),
		ev("b", EventComplete, 1, d),
		ev("a", EventPartial, 1, d),
		ev("d", EventComplete, 1, d),
		ev("e", EventDropped, 1, d),
		ev("f", EventComplete, 1, other),
	} {
		require.True(t, r.apply(e))
	}
	hs := r.Holders(d)
	assert.Equal(t, []string{"b:complete", "d:complete", "a:partial", "c:partial"}, holderList(hs))
	assert.Equal(t, clock.now(), hs[0].Seen)
	assert.Equal(t, []string{"f:complete"}, holderList(r.Holders(other)))
}

func TestRouterNewestWins(t *testing.T) {
	t.Parallel()
	r, clock := newTestRouter(time.Minute)
	d := testDigest(1)

	require.True(t, r.apply(ev("a", EventPartial, 10, d)))
	require.True(t, r.apply(ev("a", EventComplete, 11, d)))
	// An older event relayed late changes nothing and is not news.
	assert.False(t, r.apply(ev("a", EventPartial, 10, d)))
	assert.Equal(t, []string{"a:complete"}, holderList(r.Holders(d)))

	// The same event again is not news, but refreshes the entry.
	clock.advance(30 * time.Second)
	assert.False(t, r.apply(ev("a", EventComplete, 11, d)))
	assert.Equal(t, clock.now(), r.Holders(d)[0].Seen)

	// A drop is news, and an older claim cannot undo it.
	require.True(t, r.apply(ev("a", EventDropped, 12, d)))
	assert.Empty(t, r.Holders(d))
	assert.False(t, r.apply(ev("a", EventComplete, 11, d)))
	assert.Empty(t, r.Holders(d))
	// A newer one can: the peer fetched the blob again.
	require.True(t, r.apply(ev("a", EventPartial, 13, d)))
	assert.Equal(t, []string{"a:partial"}, holderList(r.Holders(d)))
}

func TestRouterExpiry(t *testing.T) {
	t.Parallel()
	r, clock := newTestRouter(time.Minute)
	d := testDigest(1)
	require.True(t, r.apply(ev("a", EventComplete, 1, d)))
	require.True(t, r.apply(ev("b", EventComplete, 1, d)))

	// Push/pull from a refreshes its entry; b's is not refreshed.
	clock.advance(40 * time.Second)
	r.merge(holdingState{Node: "a", Clock: 1, Holdings: []holding{{Kind: EventComplete, Seq: 1, Digest: d}}})
	clock.advance(40 * time.Second)
	assert.Equal(t, []string{"a:complete"}, holderList(r.Holders(d)))

	clock.advance(time.Minute)
	assert.Empty(t, r.Holders(d))

	// The sweep removes expired entries from memory too.
	require.True(t, r.apply(ev("c", EventComplete, 1, testDigest(2))))
	r.mu.Lock()
	defer r.mu.Unlock()
	assert.NotContains(t, r.remote, "a")
	assert.NotContains(t, r.remote, "b")
	assert.Contains(t, r.remote, "c")
}

func TestRouterForget(t *testing.T) {
	t.Parallel()
	r, clock := newTestRouter(time.Minute)
	d1, d2 := testDigest(1), testDigest(2)
	require.True(t, r.apply(ev("a", EventComplete, 5, d1)))
	require.True(t, r.apply(ev("a", EventPartial, 6, d2)))
	require.True(t, r.apply(ev("b", EventComplete, 1, d1)))

	r.Forget("a")
	assert.Equal(t, []string{"b:complete"}, holderList(r.Holders(d1)))
	assert.Empty(t, r.Holders(d2))

	// Gossip about a, even newer, is ignored until it joins again: it left.
	assert.False(t, r.apply(ev("a", EventComplete, 7, d2)))
	r.merge(holdingState{Node: "a", Clock: 7, Holdings: []holding{{Kind: EventComplete, Seq: 7, Digest: d2}}})
	assert.Empty(t, r.Holders(d2))

	// Back again: its old announcements, still relayed, stay forgotten;
	// new ones count.
	r.joined("a")
	assert.False(t, r.apply(ev("a", EventComplete, 6, d2)))
	assert.Empty(t, r.Holders(d2))
	require.True(t, r.apply(ev("a", EventComplete, 8, d2)))
	assert.Equal(t, []string{"a:complete"}, holderList(r.Holders(d2)))

	// The record of a departure goes after ttl.
	r.Forget("b")
	clock.advance(2 * time.Minute)
	r.apply(ev("c", EventComplete, 1, d1))
	r.mu.Lock()
	defer r.mu.Unlock()
	assert.Empty(t, r.forgotten)
}

func TestRouterMergeState(t *testing.T) {
	t.Parallel()
	r, _ := newTestRouter(time.Minute)
	d1, d2, d3, d4 := testDigest(1), testDigest(2), testDigest(3), testDigest(4)
	require.True(t, r.apply(ev("a", EventComplete, 1, d1)))
	require.True(t, r.apply(ev("a", EventComplete, 2, d2)))
	require.True(t, r.apply(ev("a", EventComplete, 30, d3))) // newer than the snapshot below

	// A complete state at clock 20 lists d1 and d4: a no longer holds d2 (it
	// missed the drop), while d3 changed after the snapshot and stays.
	r.merge(holdingState{Node: "a", Clock: 20, Holdings: []holding{
		{Kind: EventPartial, Seq: 15, Digest: d4},
		{Kind: EventComplete, Seq: 1, Digest: d1},
	}})
	assert.Equal(t, []string{"a:complete"}, holderList(r.Holders(d1)))
	assert.Empty(t, r.Holders(d2))
	assert.Equal(t, []string{"a:complete"}, holderList(r.Holders(d3)))
	assert.Equal(t, []string{"a:partial"}, holderList(r.Holders(d4)))
	// The drop holds against the old claim, still relayed.
	assert.False(t, r.apply(ev("a", EventComplete, 2, d2)))
	assert.Empty(t, r.Holders(d2))

	// A truncated state drops nothing it leaves out.
	require.True(t, r.apply(ev("b", EventComplete, 1, d1)))
	r.merge(holdingState{Node: "b", Clock: 50, Truncated: true, Holdings: []holding{{Kind: EventComplete, Seq: 40, Digest: d2}}})
	assert.Equal(t, []string{"a:complete", "b:complete"}, holderList(r.Holders(d1)))
	assert.Equal(t, []string{"b:complete"}, holderList(r.Holders(d2)))
}

func TestRouterLocal(t *testing.T) {
	t.Parallel()
	r, clock := newTestRouter(time.Minute)
	d1, d2 := testDigest(1), testDigest(2)
	require.NoError(t, r.SetLocal(EventPartial, d1))
	require.NoError(t, r.SetLocal(EventComplete, d2))
	require.NoError(t, r.SetLocal(EventComplete, d1))
	assert.Equal(t, map[digest.Digest]EventKind{d1: EventComplete, d2: EventComplete}, r.Local())
	require.NoError(t, r.SetLocal(EventDropped, d2))
	assert.Equal(t, map[digest.Digest]EventKind{d1: EventComplete}, r.Local())
	assert.Empty(t, r.Holders(d1), "the local node is not its own holder")

	require.ErrorIs(t, r.SetLocal(EventKind(0), d1), content.ErrInvalid)
	require.ErrorIs(t, r.SetLocal(EventComplete, "sha256:nothex"), content.ErrInvalid)

	// Changes are numbered in order even when the clock stands still or
	// steps back.
	h1, err := r.setLocal(EventPartial, d2)
	require.NoError(t, err)
	clock.advance(-time.Hour)
	h2, err := r.setLocal(EventComplete, d2)
	require.NoError(t, err)
	assert.Greater(t, h2.Seq, h1.Seq)
}

func TestRouterLocalStateNewestFirstAndBounded(t *testing.T) {
	t.Parallel()
	r, _ := newTestRouter(time.Minute)
	const n = 2000
	for i := range n {
		require.NoError(t, r.SetLocal(EventComplete, testDigest(i)))
	}
	b, err := r.localState("me")
	require.NoError(t, err)
	require.LessOrEqual(t, len(b), maxStateSize)
	st, err := decodeState(b)
	require.NoError(t, err)
	assert.Equal(t, "me", st.Node)
	assert.True(t, st.Truncated)
	require.NotEmpty(t, st.Holdings)
	assert.Less(t, len(st.Holdings), n)
	for i, h := range st.Holdings {
		assert.Equal(t, testDigest(n-1-i), h.Digest, "holding %d", i)
	}

	// A receiving router learns them all.
	other, _ := newTestRouter(time.Minute)
	other.merge(st)
	assert.Equal(t, []string{"me:complete"}, holderList(other.Holders(testDigest(n-1))))
}

func TestRouterConcurrent(t *testing.T) {
	t.Parallel()
	r := NewRouter(time.Minute)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			peer := fmt.Sprint("peer-", w)
			for i := range 200 {
				d := testDigest(i % 10)
				r.apply(ev(peer, EventKind(1+i%3), uint64(i), d))
				r.Holders(d)
				_ = r.SetLocal(EventComplete, d)
				if i%50 == 0 {
					r.Forget(peer)
					r.joined(peer)
				}
			}
		})
	}
	wg.Wait()
	_, err := r.localState("me")
	require.NoError(t, err)
}

// TestRouterBoundsClaimsPerPeer: a peer's claims past maxRoutesPerPeer
// blobs are not kept, nor news; changes to blobs it holds still are, and
// other peers' claims are unaffected.
func TestRouterBoundsClaimsPerPeer(t *testing.T) {
	t.Parallel()
	r, _ := newTestRouter(time.Minute)
	for i := range maxRoutesPerPeer {
		require.True(t, r.apply(ev("a", EventComplete, uint64(i+1), testDigest(i))))
	}
	over := testDigest(maxRoutesPerPeer)
	assert.False(t, r.apply(ev("a", EventComplete, maxRoutesPerPeer+1, over)))
	assert.Empty(t, r.Holders(over))
	require.True(t, r.apply(ev("a", EventDropped, maxRoutesPerPeer+2, testDigest(0))))
	assert.Empty(t, r.Holders(testDigest(0)))
	require.True(t, r.apply(ev("b", EventComplete, 1, over)))
	assert.Equal(t, []string{"b:complete"}, holderList(r.Holders(over)))
}

// TestRouterLiveMembersDoNotLapse: a live member's claims stay until it
// drops them or leaves, however long since they were heard. A pair of
// members push/pulls only about every PushPullInterval × N/2 (75 minutes
// at N = 100), so with expiry most quiet holders would lapse.
func TestRouterLiveMembersDoNotLapse(t *testing.T) {
	t.Parallel()
	r, clock := newTestRouter(time.Minute)
	d := testDigest(1)
	r.joined("a")
	require.True(t, r.apply(ev("a", EventComplete, 1, d)))
	require.True(t, r.apply(ev("b", EventComplete, 1, d))) // never joined: expires
	clock.advance(time.Hour)
	assert.Equal(t, []string{"a:complete"}, holderList(r.Holders(d)))

	// A drop's tombstone still expires, so tombstones do not pile up.
	require.True(t, r.apply(ev("a", EventDropped, 2, d)))
	assert.Empty(t, r.Holders(d))
	clock.advance(2 * time.Minute)
	r.apply(ev("a", EventPartial, 3, testDigest(2))) // sweeps
	r.mu.Lock()
	assert.NotContains(t, r.remote["a"], d)
	r.mu.Unlock()

	// Once it leaves, it is forgotten at once; back again, its new claims
	// do not lapse either.
	r.Forget("a")
	assert.Empty(t, r.Holders(testDigest(2)))
	r.joined("a")
	require.True(t, r.apply(ev("a", EventComplete, 4, d)))
	clock.advance(time.Hour)
	assert.Equal(t, []string{"a:complete"}, holderList(r.Holders(d)))
}
