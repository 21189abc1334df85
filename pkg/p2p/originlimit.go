package p2p

import (
	"cmp"
	"hash/fnv"
	"maps"
	"slices"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/time/rate"

	"github.com/weightd/weightd/pkg/content"
)

// The origin limits (SwarmConfig.OriginLimit, OriginLimits) cap what each
// origin sends the whole cluster, with no component that sees every fetch:
// each node paces its reads of an origin at its part of that origin's
// limit. The parts go by (blob, origin fetcher) pairs of the origin, split
// evenly: a node takes the parts of its own pairs. It counts the origin's
// pairs two ways and takes the larger: those its fills see (the origin
// fetchers of its blobs, OriginFetchers of each, spread by the election),
// exact at once for the blobs it fills; and those the members gossip
// (NodeMeta.OriginFetches, each node's count of blobs it fetches from each
// limited origin, published as it changes), which also count blobs that
// other nodes fill, a moment late. A fetcher whose role lingers after its
// fill still counts: the parts err below the limit.
//
// A member's count is taken up to maxCountedFetches: a compromised member
// that claims more lowers the others' parts (the origin then sends less,
// never more), and no further. Two origins whose keys collide share their
// counts, which errs the same way.

// Origin is where a blob comes from when no peer has it: its reader, and
// the name the origin limits know it by (ref.Ref.Origin: a registry's
// host, "hf", "s3").
type Origin struct {
	Name string
	content.RangeOpener
}

// OriginKey is an origin's name as gossip carries it (NodeMeta.OriginFetches):
// 32 bits of its hash, as a name can be 255 bytes and node metadata holds
// 512 in all.
type OriginKey uint32

// OriginKeyOf returns the key of the origin called name; never
// otherOrigins.
func OriginKeyOf(name string) OriginKey {
	h := fnv.New32a()
	h.Write([]byte(name))
	return max(OriginKey(h.Sum32()), otherOrigins+1)
}

// otherOrigins is the key under which a node counts its fetches of
// origins it does not name: those past what its metadata holds, or all of
// an older agent's, which gossips one total. They count against every
// origin, so a part errs below its limit, never above.
const otherOrigins OriginKey = 0

// maxCountedFetches bounds one member's gossiped count for an origin: more
// blobs than a node's fills fetch from the origin at once.
const maxCountedFetches = 64

// maxOriginParts bounds the origins a node paces apart; reads of any
// further origin share one part of the default limit, paced more tightly,
// never less (a pod author can name any registry).
const maxOriginParts = 256

// originPart is this node's pacing of one limited origin.
type originPart struct {
	key   OriginKey
	limit int64
	pace  *rate.Limiter
	// fetchers are the origin fetchers each of this node's fills from
	// the origin sees, by blob.
	fetchers map[digest.Digest][]string
}

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

// originLimit is the limit of the origin called name; 0 for none.
func (c SwarmConfig) originLimit(name string) int64 {
	if limit, ok := c.OriginLimits[name]; ok {
		return limit
	}
	return c.OriginLimit
}

// originPace returns the limiter of the origin called name, nil when it has
// no limit.
func (s *Swarm) originPace(name string) *rate.Limiter {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.originPart(name); p != nil {
		return p.pace
	}
	return nil
}

// originPart returns the pacing of the origin called name, made on first
// use, or nil when it has no limit; s.mu must be held.
func (s *Swarm) originPart(name string) *originPart {
	if p, ok := s.origins[name]; ok {
		return p
	}
	limit := s.cfg.originLimit(name)
	if limit <= 0 {
		return nil
	}
	if _, named := s.cfg.OriginLimits[name]; !named && len(s.origins) >= maxOriginParts {
		name, limit = "", s.cfg.OriginLimit
		if p, ok := s.origins[name]; ok {
			return p
		}
	}
	p := &originPart{key: OriginKeyOf(name), limit: limit, pace: newLimiter(limit), fetchers: map[digest.Digest][]string{}}
	s.origins[name] = p
	p.pace.SetLimit(originRate(limit, 0, 0, s.clusterFetches()[p.key]))
	return p
}

// clusterEvery is how often a node sums the members' counts: listing
// them costs a sort of every member, and every fill's loop asks.
const clusterEvery = 250 * time.Millisecond

// clusterFetches sums the other members' gossiped counts of origin
// fetches by origin, taken from the directory at most every clusterEvery;
// s.mu must be held.
func (s *Swarm) clusterFetches() map[OriginKey]int {
	now := s.cfg.Now()
	if !s.clusterAt.IsZero() && now.Sub(s.clusterAt) < clusterEvery {
		return s.cluster
	}
	s.clusterAt, s.cluster = now, map[OriginKey]int{}
	for _, p := range s.dir.Members() {
		for key, n := range p.Meta.OriginFetches {
			s.cluster[key] += min(n, maxCountedFetches)
		}
	}
	return s.cluster
}

// seeFetchers records the origin fetchers that fill d, from the origin
// called origin, sees now (nil once it ends), sets this node's part of
// every limited origin, and publishes its counts when they changed.
func (s *Swarm) seeFetchers(origin string, d digest.Digest, fetchers []string) {
	local := s.dir.LocalName()
	s.mu.Lock()
	part := s.originPart(origin)
	if part == nil {
		s.mu.Unlock()
		return
	}
	if fetchers == nil {
		delete(part.fetchers, d)
	} else {
		part.fetchers[d] = fetchers
	}
	cluster := s.clusterFetches()
	counts := map[OriginKey]int{}
	for _, p := range s.origins {
		mine, all := pairs(local, p.fetchers)
		p.pace.SetLimit(originRate(p.limit, mine, all, cluster[p.key]+cluster[otherOrigins]))
		if mine > 0 {
			counts[p.key] += mine
		}
	}
	counts = gossipedFetches(counts)
	changed := !maps.Equal(counts, s.published)
	s.published = counts
	s.mu.Unlock()
	if changed && s.cfg.PublishOriginFetches != nil {
		s.cfg.PublishOriginFetches(counts)
	}
}

// gossipedFetches fits a node's counts to its metadata, each at most
// maxCountedFetches: every origin by its key where they fit; else those it
// fetches most from, and the rest together under otherOrigins.
func gossipedFetches(counts map[OriginKey]int) map[OriginKey]int {
	keys := slices.Collect(maps.Keys(counts))
	slices.SortFunc(keys, func(a, b OriginKey) int { return cmp.Or(cmp.Compare(counts[b], counts[a]), cmp.Compare(a, b)) })
	out := make(map[OriginKey]int, min(len(keys), maxMetaOrigins))
	for i, k := range keys {
		key := k
		if len(keys) > maxMetaOrigins && i >= maxMetaOrigins-1 {
			key = otherOrigins
		}
		out[key] = min(out[key]+counts[k], maxCountedFetches)
	}
	return out
}

// paceOrigin tells the swarm which origin fetchers this fill sees: this
// node, while it holds the role, with those it counts in its share (the
// first of the election's order that may have taken the role at the same
// moment included), else the peers whose state says they fetch the blob.
func (f *fill) paceOrigin() {
	if f.s.cfg.originLimit(f.origin.Name) <= 0 {
		return
	}
	if f.originRole {
		_, fetchers := f.originShare()
		f.s.seeFetchers(f.origin.Name, f.d, fetchers)
		return
	}
	fetchers := []string{}
	for _, pv := range f.peers.all() {
		name := pv.name
		if pv.known && pv.state.Origin && !f.s.Banned(name) {
			fetchers = append(fetchers, name)
		}
	}
	f.s.seeFetchers(f.origin.Name, f.d, fetchers)
}
