package p2p

import (
	"iter"
	"math/rand/v2"
	"slices"
	"sync"
)

// peerSet is the holders one download follows: by name, and in the order
// they were followed, so that a seeded random source (SwarmConfig.Rand)
// repeats every choice that walks them. The zero value is empty.
type peerSet struct {
	byName map[string]*peerView
	list   []*peerView
}

// get is the followed peer named name, or nil.
func (s *peerSet) get(name string) *peerView { return s.byName[name] }

// len is how many peers are followed.
func (s *peerSet) len() int { return len(s.list) }

// add follows pv, in place of any peer of its name.
func (s *peerSet) add(pv *peerView) {
	s.remove(pv.name)
	if s.byName == nil {
		s.byName = map[string]*peerView{}
	}
	s.byName[pv.name] = pv
	s.list = append(s.list, pv)
}

// remove stops following the peer named name.
func (s *peerSet) remove(name string) {
	if s.byName[name] == nil {
		return
	}
	delete(s.byName, name)
	// A new list: a walk under way keeps the one it began with.
	i := slices.IndexFunc(s.list, func(pv *peerView) bool { return pv.name == name })
	s.list = slices.Concat(s.list[:i], s.list[i+1:])
}

// from walks the followed peers from a place r draws, as a map's range
// does: of peers that tie in a choice, the first met is picked, and a
// fixed start would send every node to the same one. The peers are those
// followed when the walk began.
func (s *peerSet) from(r *rand.Rand) iter.Seq[*peerView] {
	list := s.list
	return func(yield func(*peerView) bool) {
		if len(list) == 0 {
			return
		}
		start := r.IntN(len(list))
		for k := range list {
			if !yield(list[(start+k)%len(list)]) {
				return
			}
		}
	}
}

// all walks the followed peers in the order they were followed, where the
// order decides nothing (sums, counts, a search for any one).
func (s *peerSet) all() []*peerView { return s.list }

// runtimeSource is the runtime's random source, which needs no lock.
type runtimeSource struct{}

func (runtimeSource) Uint64() uint64 { return rand.Uint64() }

// lockedSource lets the fills of one swarm, each on its own goroutine,
// share a seeded source.
type lockedSource struct {
	mu  sync.Mutex
	src rand.Source
}

func (l *lockedSource) Uint64() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.src.Uint64()
}

// newRand is the swarm's random numbers from src, or from the runtime's
// source when src is nil.
func newRand(src rand.Source) *rand.Rand {
	if src == nil {
		return rand.New(runtimeSource{})
	}
	return rand.New(&lockedSource{src: src})
}
