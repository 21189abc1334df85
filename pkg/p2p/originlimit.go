package p2p

import (
	"slices"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/time/rate"
)

// The origin limit (SwarmConfig.OriginLimit) caps what the origin sends the
// whole cluster, with no component that sees every fetch: each node paces
// its own origin reads at its part of the limit. The parts go by (blob,
// origin fetcher) pairs, split evenly: a node takes the parts of its own
// pairs. It counts the cluster's pairs two ways and takes the larger:
// those its fills see (the origin fetchers of its blobs, OriginFetchers
// of each, spread by the election), exact at once for the blobs it fills;
// and those the members gossip (NodeMeta.OriginFetches, each node's count
// of blobs it fetches, published as it changes), which also count blobs
// that other nodes fill, a moment late. A fetcher whose role lingers after
// its fill still counts: the parts err below the limit.
//
// A member's count is taken up to maxCountedFetches: a compromised member
// that claims more lowers the others' parts (the origin then sends less,
// never more), and no further.

// maxCountedFetches bounds one member's gossiped count: more blobs than a
// node's fills fetch from the origin at once.
const maxCountedFetches = 64

// originRate is a node's part of limit, given the pairs its fills see
// (pairs: mine of all) and those the other members gossip. A node that
// fetches nothing for the cluster but still reads the origin (a small
// blob, a stream outside the swarm) counts as one more pair.
func originRate(limit int64, mine, all, others int) rate.Limit {
	if mine == 0 {
		mine, all = 1, all+1
	}
	all = max(all, others+mine)
	return rate.Limit(float64(limit) * float64(mine) / float64(all))
}

// pairs counts the (blob, origin fetcher) pairs in fetchers, the origin
// fetchers each of a node's fills sees: local's, and all.
func pairs(local string, fetchers map[digest.Digest][]string) (mine, all int) {
	for _, names := range fetchers {
		all += len(names)
		if slices.Contains(names, local) {
			mine++
		}
	}
	return mine, all
}

// clusterEvery is how often a node sums the members' counts: listing
// them costs a sort of every member, and every fill's loop asks.
const clusterEvery = 250 * time.Millisecond

// clusterFetches is the sum of the other members' gossiped counts of
// origin fetches, taken from the directory at most every clusterEvery;
// s.mu must be held.
func (s *Swarm) clusterFetches() int {
	now := s.cfg.Now()
	if !s.clusterAt.IsZero() && now.Sub(s.clusterAt) < clusterEvery {
		return s.cluster
	}
	s.clusterAt, s.cluster = now, 0
	for _, p := range s.dir.Members() {
		s.cluster += min(p.Meta.OriginFetches, maxCountedFetches)
	}
	return s.cluster
}

// seeFetchers records the origin fetchers fill d sees now (nil once it
// ends) and sets this node's part of the origin limit from all its fills'.
func (s *Swarm) seeFetchers(d digest.Digest, fetchers []string) {
	if s.originPace == nil {
		return
	}
	local := s.dir.LocalName()
	s.mu.Lock()
	if fetchers == nil {
		delete(s.fetchers, d)
	} else {
		s.fetchers[d] = fetchers
	}
	mine, all := pairs(local, s.fetchers)
	changed := mine != s.published
	s.published = mine
	s.originPace.SetLimit(originRate(s.cfg.OriginLimit, mine, all, s.clusterFetches()))
	s.mu.Unlock()
	if changed && s.cfg.PublishOriginFetches != nil {
		s.cfg.PublishOriginFetches(mine)
	}
}

// paceOrigin tells the swarm which origin fetchers this fill sees: this
// node, while it holds the role, with those it counts in its share (the
// first of the election's order that may have taken the role at the same
// moment included), else the peers whose state says they fetch the blob.
func (f *fill) paceOrigin() {
	if f.s.originPace == nil {
		return
	}
	if f.originRole {
		_, fetchers := f.originShare()
		f.s.seeFetchers(f.d, fetchers)
		return
	}
	fetchers := []string{}
	for name, pv := range f.peers {
		if pv.known && pv.state.Origin && !f.s.Banned(name) {
			fetchers = append(fetchers, name)
		}
	}
	f.s.seeFetchers(f.d, fetchers)
}
