package p2p

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// Holder is a peer that announced it holds some or all of a blob.
type Holder struct {
	// Peer is the member name; Membership.Peer gives its chunk address.
	Peer string
	// Complete is true when the peer holds the whole verified blob, false
	// while it is still downloading it (it serves the chunks it has).
	Complete bool
	// Seen is when this node last heard the claim, from gossip or push/pull.
	Seen time.Time
}

// Router knows which peers hold which blobs, and what the local node holds.
// It learns from a Membership's gossip: events as they are announced, and
// each peer's full list of holdings in every push/pull with it.
//
// Every change a node makes to its holdings carries a number from that
// node's clock (nanoseconds since the epoch when it started, then counting
// up), so a relayed, out-of-date event never overwrites a newer one, and a
// restarted node's announcements supersede those of its previous life. A
// live member's claims last until it drops them or leaves (Forget): nodes
// re-announce nothing, and a pair of members push/pulls only about every
// scaled push/pull interval × N/2 (75 minutes at 100 members, a day at
// 1,000), so any ttl short enough to matter would drop quiet holders
// (docs/gossip-scale.md). Other entries, tombstones among them, live for
// ttl from the last time they were heard.
//
// A Router is safe for concurrent use.
type Router struct {
	ttl time.Duration
	now func() time.Time // replaced in tests

	mu        sync.Mutex
	remote    map[string]map[digest.Digest]routeEntry // by peer, then blob
	live      map[string]bool                         // members, from joined to Forget
	forgotten map[string]routeForgotten
	local     map[digest.Digest]holding
	clock     uint64 // the last seq given to a local change
	lastSweep time.Time
}

// routeEntry is what a peer last said about a blob. An EventDropped entry is
// a tombstone: it keeps older events about the blob, still being relayed,
// from bringing the entry back.
type routeEntry struct {
	kind EventKind
	seq  uint64
	seen time.Time
}

// routeForgotten remembers a peer Forget removed: while left is true nothing
// about it is accepted (stale gossip about a node that left must not
// resurrect it); once it joins again, only changes newer than floor are.
type routeForgotten struct {
	at    time.Time
	floor uint64
	left  bool
}

// maxRoutesPerPeer bounds the blobs the router keeps of one peer's claims,
// tombstones included, so that a member claiming made-up blobs cannot grow
// it without end (about 150 bytes each). A real node holding more is still
// found for the ones it announced first and through its push/pull state.
const maxRoutesPerPeer = 1 << 13

// defaultRouteTTL is the ttl NewRouter uses when given none. Departures
// and drops are handled by Forget, EventDropped and push/pull; expiry only
// ends tombstones and claims of peers that are not members.
const defaultRouteTTL = 30 * time.Minute

// NewRouter returns an empty router whose remote entries, but live
// members' claims, expire ttl after they were last heard; ttl <= 0 means 30
// minutes.
func NewRouter(ttl time.Duration) *Router {
	if ttl <= 0 {
		ttl = defaultRouteTTL
	}
	r := &Router{
		ttl:       ttl,
		now:       time.Now,
		remote:    make(map[string]map[digest.Digest]routeEntry),
		live:      make(map[string]bool),
		forgotten: make(map[string]routeForgotten),
		local:     make(map[digest.Digest]holding),
	}
	r.clock = uint64(r.now().UnixNano())
	return r
}

// Holders returns the peers that hold d, complete holders first, then by
// name. The local node is never among them.
func (r *Router) Holders(d digest.Digest) []Holder {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	var hs []Holder
	for peer, blobs := range r.remote {
		e, ok := blobs[d]
		if !ok || e.kind == EventDropped || r.expired(peer, e, now) {
			continue
		}
		hs = append(hs, Holder{Peer: peer, Complete: e.kind == EventComplete, Seen: e.seen})
	}
	slices.SortFunc(hs, func(a, b Holder) int {
		if a.Complete != b.Complete {
			if a.Complete {
				return -1
			}
			return 1
		}
		return cmp.Compare(a.Peer, b.Peer)
	})
	return hs
}

// Forget removes everything known about peer at once, and ignores gossip
// about it until it joins again. Membership calls it when a peer leaves or
// is declared dead.
func (r *Router) Forget(peer string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f := r.forgotten[peer]
	for _, e := range r.remote[peer] {
		f.floor = max(f.floor, e.seq)
	}
	f.at, f.left = r.now(), true
	r.forgotten[peer] = f
	delete(r.remote, peer)
	delete(r.live, peer)
}

// joined records peer as a live member, whose claims do not lapse, and
// lifts Forget's ban on gossip about it.
func (r *Router) joined(peer string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.live[peer] = true
	if f, ok := r.forgotten[peer]; ok {
		f.left = false
		r.forgotten[peer] = f
	}
}

// Local returns the local node's own holdings, as set with SetLocal: each
// blob it holds with EventComplete or EventPartial.
func (r *Router) Local() map[digest.Digest]EventKind {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := make(map[digest.Digest]EventKind, len(r.local))
	for d, h := range r.local {
		m[d] = h.Kind
	}
	return m
}

// SetLocal records a change to the local node's own holdings; EventDropped
// removes d. Peers learn of it in push/pull; Membership.Announce calls
// SetLocal and also gossips the change at once.
func (r *Router) SetLocal(kind EventKind, d digest.Digest) error {
	_, err := r.setLocal(kind, d)
	return err
}

// setLocal is SetLocal returning the change as a holding to gossip.
func (r *Router) setLocal(kind EventKind, d digest.Digest) (holding, error) {
	if !kind.valid() {
		return holding{}, fmt.Errorf("%w: event kind %v", content.ErrInvalid, kind)
	}
	if err := content.ValidateDigest(d); err != nil {
		return holding{}, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clock = max(r.clock+1, uint64(r.now().UnixNano()))
	h := holding{Kind: kind, Seq: r.clock, Digest: d}
	if kind == EventDropped {
		delete(r.local, d)
	} else {
		r.local[d] = h
	}
	return h, nil
}

// localState snapshots the local holdings of node, newest first, encoded
// within maxStateSize.
func (r *Router) localState(node string) ([]byte, error) {
	r.mu.Lock()
	st := holdingState{Node: node, Clock: r.clock, Holdings: make([]holding, 0, len(r.local))}
	for _, h := range r.local {
		st.Holdings = append(st.Holdings, h)
	}
	r.mu.Unlock()
	slices.SortFunc(st.Holdings, func(a, b holding) int { return cmp.Compare(b.Seq, a.Seq) })
	return encodeState(st, maxStateSize)
}

// apply records a remote holding change and reports whether it was news:
// newer than anything known about that peer and blob. A repeat of what is
// known only refreshes it.
func (r *Router) apply(ev holdingEvent) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	r.sweepLocked(now)
	return r.applyLocked(ev.Node, ev.holding, now)
}

func (r *Router) applyLocked(peer string, h holding, now time.Time) bool {
	if f, ok := r.forgotten[peer]; ok && (f.left || h.Seq <= f.floor) {
		return false
	}
	blobs := r.remote[peer]
	if e, ok := blobs[h.Digest]; ok && !r.expired(peer, e, now) {
		if h.Seq < e.seq {
			return false
		}
		if h.Seq == e.seq {
			e.seen = now
			blobs[h.Digest] = e
			return false
		}
	}
	if _, ok := blobs[h.Digest]; !ok && len(blobs) >= maxRoutesPerPeer {
		return false
	}
	if blobs == nil {
		blobs = make(map[digest.Digest]routeEntry)
		r.remote[peer] = blobs
	}
	blobs[h.Digest] = routeEntry{kind: h.Kind, seq: h.Seq, seen: now}
	return true
}

// merge records a peer's push/pull state: every holding in it is applied,
// and, when the state is complete, the peer's entries it no longer lists and
// that are no newer than the snapshot become tombstones.
func (r *Router) merge(st holdingState) {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	r.sweepLocked(now)
	if f, ok := r.forgotten[st.Node]; ok && f.left {
		return
	}
	listed := make(map[digest.Digest]bool, len(st.Holdings))
	for _, h := range st.Holdings {
		listed[h.Digest] = true
		r.applyLocked(st.Node, h, now)
	}
	if st.Truncated {
		return
	}
	for d, e := range r.remote[st.Node] {
		if !listed[d] && e.kind != EventDropped && e.seq <= st.Clock {
			r.remote[st.Node][d] = routeEntry{kind: EventDropped, seq: st.Clock, seen: now}
		}
	}
}

func (r *Router) expired(peer string, e routeEntry, now time.Time) bool {
	if e.kind != EventDropped && r.live[peer] {
		return false
	}
	return now.Sub(e.seen) > r.ttl
}

// sweepLocked removes expired entries and old Forget records, at most every
// quarter ttl so that its cost is spread thin.
func (r *Router) sweepLocked(now time.Time) {
	if now.Sub(r.lastSweep) < r.ttl/4 {
		return
	}
	r.lastSweep = now
	for peer, blobs := range r.remote {
		for d, e := range blobs {
			if r.expired(peer, e, now) {
				delete(blobs, d)
			}
		}
		if len(blobs) == 0 {
			delete(r.remote, peer)
		}
	}
	for peer, f := range r.forgotten {
		if now.Sub(f.at) > r.ttl {
			delete(r.forgotten, peer)
		}
	}
}
