package p2p

import (
	"slices"
	"time"
)

// Following: a download reads the chunk states only of the holders it
// follows, and asks only them for chunks. Every state read waits at its
// holder for news, so following every holder would cost each node a read
// per holder per change, N² over a cluster of N that fills one blob. A
// download follows at most MaxFollowed holders: those that decide the
// origin role (the first holders in election order, and any that say
// they fetch from the origin), then others drawn at random, of its own
// zone first. Every rotateEvery it stops following the one with least of
// what it misses, making room for another: the chunks a node lacks are
// soon found wherever they are. Once the role is settled (plan.settled),
// the origin fetchers are followed as any holder: each chunk they fetch
// leaves them once, and every node following them would load their
// links with state reads, N of them at each change.

// rotateEvery is how often a download that follows as many holders as it
// may drops its least useful one for another.
const rotateEvery = 2 * time.Second

// leaders is how many of the first holders in election order a download
// always follows: the origin fetchers and the next in line.
func (f *plan) leaders() int { return f.s.cfg.OriginFetchers + 1 }

// hearHolders keeps the holders gossip names, which Holders lists complete
// first.
func (f *plan) hearHolders(holders []Holder) {
	f.holders, f.completes = f.holders[:0], 0
	for _, h := range holders {
		f.holders = append(f.holders, h.Peer)
		if h.Complete {
			f.completes++
		}
	}
}

// follow starts to follow holders of the blob that gossip names, within
// MaxFollowed, at most once per Refresh: the first in election order
// always, then others at random (complete ones first, then of this node's
// zone, then any), and with as many followed as it may, drops the least
// useful every rotateEvery.
func (f *plan) follow(now time.Time, missing []int) {
	if !f.followedAt.IsZero() && now.Sub(f.followedAt) < f.refreshEvery() {
		return
	}
	f.followedAt = now
	holders := f.s.dir.Holders(f.d)
	f.hearHolders(holders)
	complete := f.completes
	if now.Sub(f.leadersAt) >= f.rankEvery(now) {
		f.leadersAt = now
		order := f.electionOrder(append([]string{f.s.dir.LocalName()}, f.holders...))
		f.leading = append(f.leading[:0], order[:min(len(order), f.leaders())]...)
	}
	if f.settledOn == nil {
		for _, name := range f.leading {
			f.addPeer(name, now)
		}
	}
	f.unfollowFetchers(now)
	limit := f.s.cfg.MaxFollowed
	if len(holders) <= limit {
		for _, name := range f.holders {
			f.addPeer(name, now)
		}
		return
	}
	switch {
	case f.peers.len() < limit:
		f.rotatedAt = now // rotation counts from when the places are full
	case now.Sub(f.rotatedAt) >= rotateEvery:
		f.rotatedAt = now
		f.dropLeastUseful(missing, now)
	}
	// Complete holders all, if they fit; else drawn, as then the others:
	// a few tries per free place in each pass, and a holder drawn that
	// cannot be followed (found absent or dropped lately, gone, this node)
	// costs a try.
	if complete <= limit-f.peers.len() {
		for _, name := range f.holders[:complete] {
			f.addPeer(name, now)
		}
		complete = 0
	}
	for pass := range 3 {
		pool, sameZone := len(holders), pass == 1
		if pass == 0 {
			pool = complete
		}
		for tries := 4 * (limit - f.peers.len()); pool > 0 && tries > 0 && f.peers.len() < limit; tries-- {
			name := f.holders[f.s.rand.IntN(pool)]
			if (sameZone && f.zoneOf(name) != f.s.cfg.Zone) || (slices.Contains(f.settledOn, name) && f.dropsFetchers()) {
				continue
			}
			f.addPeer(name, now)
		}
	}
}

// dropLeastUseful stops following the peer that has or receives the
// fewest of the missing chunks, but never one whose state is still unread,
// one with requests in flight, or, until the origin role is settled, a
// leader or an origin fetcher.
func (f *plan) dropLeastUseful(missing []int, now time.Time) {
	var least *peerView
	leastUse := 0
	for pv := range f.peers.from(f.s.rand) {
		if !pv.known || pv.inflight > 0 || (f.settledOn == nil && (pv.state.Origin || slices.Contains(f.leading, pv.name))) {
			continue
		}
		use := 0
		for _, i := range missing {
			if pv.state.Has(i) || pv.state.IsFetching(i) {
				use++
			}
		}
		if least == nil || use < leastUse {
			least, leastUse = pv, use
		}
	}
	if least != nil {
		f.unfollow(least.name, now)
	}
}

// unfollow stops following name, and leaves it for a while (rankEvery).
func (f *plan) unfollow(name string, now time.Time) {
	f.peers.remove(name)
	f.absent[name] = now
}

// settle records that the origin role is settled on fetchers, and draws
// whether this download keeps following them (dropsFetchers).
func (f *plan) settle(fetchers []string) {
	f.settledOn, f.fetcherDraw = fetchers, f.s.rand.Float64()
}

// dropsFetchers reports whether the download stops following the origin
// fetchers the role settled on. Among more holders than it may follow, it
// keeps them only by the chance it would have drawn them (MaxFollowed in
// holders): they are useful to all, and would otherwise stay followed by
// all, N state reads at each change of theirs.
func (f *plan) dropsFetchers() bool {
	n := len(f.holders)
	return f.settledOn != nil && n > f.s.cfg.MaxFollowed && f.fetcherDraw >= float64(f.s.cfg.MaxFollowed)/float64(n)
}

// unfollowFetchers stops following the origin fetchers where
// dropsFetchers says so, but those with requests in flight.
func (f *plan) unfollowFetchers(now time.Time) {
	if !f.dropsFetchers() {
		return
	}
	for _, name := range f.settledOn {
		if pv := f.peers.get(name); pv != nil && pv.inflight == 0 {
			f.unfollow(name, now)
		}
	}
}
