package p2p

import (
	"context"
	"errors"
	"sync"

	"github.com/opencontainers/go-digest"
)

// liveChunk is a chunk on its way to this node: the bytes received so far,
// which the chunk server relays to peers as they come, so that a chunk
// crosses the swarm in about one transfer time however many hops it takes,
// not one transfer time per hop. The last relayPiece goes only once the
// chunk is verified and written here: a peer never completes a chunk this
// node did not verify. If the chunk fails, its relays end short and their
// receivers drop what they got.
type liveChunk struct {
	buf   *[]byte     // the whole chunk, from chunkBuffers
	among *liveChunks // where it is shared once it starts to come; nil: never
	key   chunkKey

	mu     sync.Mutex
	filled int64         // bytes received so far, from the front
	sum    []byte        // the chunk's sha256, once verified and written
	failed bool          // it will not be verified
	news   chan struct{} // closed and replaced at each change
	refs   int           // the receiver's and each relay's; the last returns buf
}

// chunkBuffers recycles chunk-sized buffers: memory stays bounded by the
// requests in flight however large the blob.
var chunkBuffers sync.Pool

// newLiveChunk returns a chunk of n bytes to receive, never shared.
func newLiveChunk(n int64) *liveChunk {
	bp, _ := chunkBuffers.Get().(*[]byte)
	if bp == nil || int64(cap(*bp)) < n {
		b := make([]byte, n)
		bp = &b
	}
	*bp = (*bp)[:n]
	return &liveChunk{buf: bp, news: make(chan struct{}), refs: 1}
}

// data is the chunk's buffer; only its first filled bytes are received.
func (c *liveChunk) data() []byte { return *c.buf }

// changed wakes the relays; c.mu is held.
func (c *liveChunk) changed() {
	close(c.news)
	c.news = make(chan struct{})
}

// progress records that the first n bytes have come.
func (c *liveChunk) progress(n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.filled = n
	c.changed()
}

// finish records the end of the transfer: verified with hash sum, or
// failed (sum nil).
func (c *liveChunk) finish(sum []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sum, c.failed = sum, sum == nil
	c.changed()
}

var errChunkFailed = errors.New("the chunk failed here")

// relayPiece is the grain of a relay: a receiver tells its relays of
// each relayPiece that has come, and a relay holds back the chunk's last
// relayPiece until the chunk is verified. Each hop adds about a piece's
// transfer time.
const relayPiece = 64 << 10

// wait blocks until bytes past off may be relayed, and returns how far
// they go, with the chunk's hash once that is its end: bytes may go once
// they have come, the last relayPiece once the chunk is verified.
func (c *liveChunk) wait(ctx context.Context, off int64) (end int64, sum []byte, err error) {
	n := int64(len(c.data()))
	for {
		c.mu.Lock()
		filled, sum, failed, news := c.filled, c.sum, c.failed, c.news
		c.mu.Unlock()
		switch {
		case failed:
			return 0, nil, errChunkFailed
		case sum != nil:
			return n, sum, nil
		case min(filled, n-relayPiece) > off:
			return min(filled, n-relayPiece), nil, nil
		}
		select {
		case <-news:
		case <-ctx.Done():
			return 0, nil, ctx.Err()
		}
	}
}

// release drops one reference; the last returns the buffer to the pool.
func (c *liveChunk) release() {
	c.mu.Lock()
	c.refs--
	last := c.refs == 0
	c.mu.Unlock()
	if last {
		chunkBuffers.Put(c.buf)
	}
}

// settle ends the transfer: verified with hash sum, or failed (sum nil).
// The chunk's relays complete or end short, it is no longer shared (a
// verified chunk is served from the blob file from now on), and the
// receiver's reference is released.
func (c *liveChunk) settle(sum []byte) {
	c.finish(sum)
	if c.among != nil {
		c.among.unshare(c)
	}
	c.release()
}

// liveChunks are the chunks this node is receiving, by blob and index.
type liveChunks struct {
	mu sync.Mutex
	m  map[chunkKey]*liveChunk
}

// chunk returns chunk i of d, n bytes, to receive; share shares it.
func (l *liveChunks) chunk(d digest.Digest, i int, n int64) *liveChunk {
	c := newLiveChunk(n)
	c.among, c.key = l, chunkKey{d, i}
	return c
}

// share tells the chunk server that c is on its way, once its source has
// answered (a request that is refused is never news), unless the same
// chunk already is (c is then an endgame duplicate, not shared).
func (c *liveChunk) share() {
	l := c.among
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, dup := l.m[c.key]; !dup {
		if l.m == nil {
			l.m = map[chunkKey]*liveChunk{}
		}
		l.m[c.key] = c
	}
}

// unshare stops sharing c if it is shared.
func (l *liveChunks) unshare(c *liveChunk) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m[c.key] == c {
		delete(l.m, c.key)
	}
}

// open returns chunk i of d if it is on its way, for a relay, which must
// release it; nil otherwise.
func (l *liveChunks) open(d digest.Digest, i int) *liveChunk {
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.m[chunkKey{d, i}]
	if c != nil {
		c.mu.Lock()
		c.refs++
		c.mu.Unlock()
	}
	return c
}

// receiving returns the bitmap of d's chunks on their way, nil if none.
func (l *liveChunks) receiving(d digest.Digest) []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b []byte
	for k := range l.m {
		if k.d == d {
			b = setBit(b, k.i, true)
		}
	}
	return b
}

// countReceiving is how many of d's chunks on their way are not in have
// (nor past its end): the bits of notHeld(receiving(d), have), without
// their copies.
func (l *liveChunks) countReceiving(d digest.Digest, have []byte) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for k := range l.m {
		if k.d == d && k.i/8 < len(have) && !bitSet(have, k.i) {
			n++
		}
	}
	return n
}
