package p2p

import (
	"math/bits"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
)

type chunkKey struct {
	d digest.Digest
	i int
}

// sentLog remembers which chunks of the most recent blobs this server has
// sent to some peer, and when and to whom it first sent those it sends
// once in their first resendAfter.
type sentLog struct {
	mu     sync.Mutex
	m      map[digest.Digest][]byte
	order  []digest.Digest       // oldest first
	recent map[chunkKey]sentOnce // first sent with once, less than resendAfter ago
}

// sentOnce is when a chunk sent once went, to which host last, and how
// often it was sent again since.
type sentOnce struct {
	at     time.Time
	to     string
	agains int
}

// SendsAgain says whether an origin fetcher sends a chunk it sent once
// again to asker, who says receiver proved no source, having sent it again
// agains times in its window: not to the receiver itself, and not past
// maxSendsAgain, however many askers take turns.
func SendsAgain(receiver, asker string, agains int) bool {
	return asker != receiver && agains < maxSendsAgain
}

// chunkAsk is a chunk request as a sentLog judges it.
type chunkAsk struct {
	once  bool   // an origin fetcher's: each chunk once in a window
	again bool   // the asker says the receiver proved no source
	from  string // the asker's host
	// member reports whether a member listens on a host (nil: every
	// host); asked only where a stranger is treated otherwise: it opens
	// no window and asks nothing again.
	member func(host string) bool
}

func (a chunkAsk) stranger() bool { return a.member != nil && !a.member(a.from) }

// mark records that chunk i of d is being sent as a asks. With once it
// refuses (false) a chunk whose first send was with once, less than
// resendAfter ago, and returns the host it went to; but with again it
// sends it, to a new receiver, where SendsAgain allows. Only the first
// send opens the window, so that no peer can hold it open by asking again
// the moment it closes. A send to a stranger is none the swarm can follow
// (a pod could ask for every chunk first): it is not recorded.
func (l *sentLog) mark(d digest.Digest, i int, a chunkAsk) (bool, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	for k, s := range l.recent {
		if now.Sub(s.at) >= resendAfter {
			delete(l.recent, k)
		}
	}
	if l.m == nil {
		l.m = make(map[digest.Digest][]byte)
	}
	b, ok := l.m[d]
	if a.once {
		k := chunkKey{d, i}
		if s, sent := l.recent[k]; sent {
			if !a.again || !SendsAgain(s.to, a.from, s.agains) || a.stranger() {
				return false, s.to
			}
			l.recent[k] = sentOnce{at: s.at, to: a.from, agains: s.agains + 1}
		} else if !bitSet(b, i) {
			if a.stranger() {
				return true, ""
			}
			if l.recent == nil {
				l.recent = make(map[chunkKey]sentOnce)
			}
			l.recent[k] = sentOnce{at: now, to: a.from}
		}
	}
	if !ok {
		l.order = append(l.order, d)
		if len(l.order) > maxSentBlobs {
			delete(l.m, l.order[0])
			l.order = l.order[1:]
		}
	}
	l.m[d] = setBit(b, i, true)
	return true, ""
}

// count is how many chunks of have were sent: the bits of get, without
// its copy.
func (l *sentLog) count(d digest.Digest, have []byte) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	b, n := l.m[d], 0
	for i := range min(len(b), len(have)) {
		n += bits.OnesCount8(b[i] & have[i])
	}
	return n
}

// get returns the sent bitmap of d shaped like have (and a subset of it),
// or nil when nothing was sent.
func (l *sentLog) get(d digest.Digest, have []byte) []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.m[d]
	if !ok {
		return nil
	}
	return intersect(b, have)
}
