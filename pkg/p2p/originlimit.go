package p2p

import (
	"slices"

	"github.com/opencontainers/go-digest"
	"golang.org/x/time/rate"
)

// The origin limit (SwarmConfig.OriginLimit) caps what the origin sends the
// whole cluster, with no component that sees every fetch: each node paces
// its own origin reads at its part of the limit, reckoned from what its
// fills know. The parts go by (blob, origin fetcher) pairs: a fill sees the
// origin fetchers of its blob (OriginFetchers, spread by the election),
// and the limit is split evenly among all the pairs this node's fills see,
// this node taking the parts of its own pairs. Where every node fills the
// same blobs (a model pulled across the cluster, the case that loads the
// origin), all nodes count the same pairs and the parts add up to the
// limit. Blobs filled by disjoint sets of nodes each see only their own
// pairs, so there the limit holds per blob. A fetcher whose role lingers
// after its fill still counts: the parts err below the limit.

// originRate is a node's part of limit, given the origin fetchers each of
// its fills sees (fetchers[d], local among them where it fetches d). A
// node that fetches nothing for the cluster but still reads the origin
// (a small blob, a stream outside the swarm) counts as one more pair.
func originRate(limit int64, local string, fetchers map[digest.Digest][]string) rate.Limit {
	mine, all := 0, 0
	for _, names := range fetchers {
		all += len(names)
		if slices.Contains(names, local) {
			mine++
		}
	}
	if mine == 0 {
		mine, all = 1, all+1
	}
	return rate.Limit(float64(limit) * float64(mine) / float64(all))
}

// seeFetchers records the origin fetchers fill d sees now (nil once it
// ends) and sets this node's part of the origin limit from all its fills'.
func (s *Swarm) seeFetchers(d digest.Digest, fetchers []string) {
	if s.originPace == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if fetchers == nil {
		delete(s.fetchers, d)
	} else {
		s.fetchers[d] = fetchers
	}
	s.originPace.SetLimit(originRate(s.cfg.OriginLimit, s.dir.LocalName(), s.fetchers))
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
