package p2p

import (
	"cmp"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// rendezvous orders names by their hash with d: every node computes the same
// order from the same set, and removing one name keeps the others' order.
func rendezvous(d digest.Digest, names []string) []string {
	type scored struct {
		name  string
		score uint64
	}
	all := make([]scored, len(names))
	for i, n := range names {
		all[i] = scored{n, rendezvousHash(d, n)}
	}
	slices.SortFunc(all, func(a, b scored) int { return cmp.Compare(b.score, a.score) })
	out := make([]string, len(all))
	for i, s := range all {
		out[i] = s.name
	}
	return out
}

// rendezvousHash is name's score for d in rendezvous order.
func rendezvousHash(d digest.Digest, name string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(d))
	h.Write([]byte{0})
	h.Write([]byte(name))
	return mix64(h.Sum64())
}

// mix64 is MurmurHash3's 64-bit finalizer. FNV-1a alone carries a name's
// last byte into the low bits only, so among names that differ in their
// last character (node-1 … node-8) one ranked first for half the blobs.
func mix64(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// decideOrigin takes the origin role when this node ranks first among the
// nodes that want the blob (or the chosen one has not shown up after its
// turn), and no peer already fetches it from the origin or holds it whole.
// A node among the first of all live members takes it at once: no node can
// rank above it, so waiting for gossip to settle would only delay the swarm.
func (f *plan) decideOrigin() {
	if f.settled() {
		return
	}
	fetchers, unknown, names := []string(nil), 0, []string{f.s.dir.LocalName()}
	for _, pv := range f.peers.all() {
		name := pv.name
		if f.s.Banned(name) {
			continue
		}
		if !f.originRole && pv.known && pv.state.Complete {
			return // a peer can serve every chunk
		}
		switch {
		case !pv.known:
			unknown++
		case pv.state.Origin:
			fetchers = append(fetchers, name)
		}
		names = append(names, name)
	}
	// Ranking costs a hash per name and a sort at every pass of the loop:
	// it is done only where it decides (docs/swarm-tuning.md).
	if f.originRole {
		// Two nodes took the role (a slow gossip, a partition that healed):
		// the one ranked lower yields, so the origin serves one copy.
		if len(fetchers) >= f.s.cfg.OriginFetchers {
			order := f.electionOrder(names)
			mine := slices.Index(order, f.s.dir.LocalName())
			above := 0
			for _, p := range fetchers {
				if slices.Index(order, p) < mine {
					above++
				}
			}
			if above >= f.s.cfg.OriginFetchers {
				f.originRole = false
				if f.originShown {
					f.s.setOrigin(f.d, false, 0)
				}
				f.s.log.Info("yielding the origin role", "digest", f.d, "to", fetchers)
				return
			}
		}
		if !f.originShown && f.rivalsHeard(f.s.cfg.Now()) {
			f.show()
		}
		return
	}
	if len(fetchers) >= f.s.cfg.OriginFetchers {
		f.settle(fetchers)
		return
	}
	// Rank among every holder gossip names, not only the followed ones,
	// so that all nodes agree on who comes first.
	for _, name := range f.holders {
		if f.peers.get(name) == nil && !f.s.Banned(name) {
			names = append(names, name)
		}
	}
	order := f.electionOrder(names)
	rank := slices.Index(order, f.s.dir.LocalName())
	members := f.s.dir.Members()
	alone := len(members) == 0 && f.peers.len() == 0
	turn := f.s.cfg.Settle * time.Duration(1+max(0, rank-(f.s.cfg.OriginFetchers-1)))
	// None can rank above a node among the first of all live members.
	first := slices.Index(f.electionOrder(f.withMembers(members)), f.s.dir.LocalName()) < f.s.cfg.OriginFetchers
	if first {
		turn = 0
	}
	// Until every holder's chunk state has been read, one of them may
	// already be the origin fetcher; wait for it, within reason.
	if unknown > 0 && f.s.cfg.Now().Sub(f.start) < turn+f.holdersWait() {
		return
	}
	if alone || f.s.cfg.Now().Sub(f.start) >= turn {
		f.originRole, f.originSince, f.originAtOnce = true, f.s.cfg.Now(), alone || first
		f.s.m.originRole.Inc()
		f.s.log.Info("fetching from the origin for the cluster", "digest", f.d, "rank", rank, "candidates", len(names))
		if f.originAtOnce {
			f.show()
			return
		}
		f.originShown, f.rivals = false, nil
		for _, name := range order[:rank] {
			if f.peers.get(name) != nil {
				f.rivals = append(f.rivals, name)
			}
		}
	}
}

// show lets peers see that this node fetches the blob from the origin.
func (f *plan) show() {
	f.originShown = true
	f.s.setOrigin(f.d, true, 0)
}

// settled reports whether the origin role is settled for this node: it
// saw OriginFetchers others take it, and they are still live members and
// not banned. It then need not follow them (follow); were one to go, the
// election is open again.
func (f *plan) settled() bool {
	for _, name := range f.settledOn {
		if _, live := f.s.dir.Peer(name); !live || f.s.Banned(name) {
			f.settledOn = nil
			for _, l := range f.leading {
				delete(f.absent, l) // dropped while settled: follow them again at once
			}
			break
		}
	}
	return f.settledOn != nil
}

// withMembers is this node's name followed by the names of members (the
// other live members).
func (f *plan) withMembers(members []Peer) []string {
	names := []string{f.s.dir.LocalName()}
	for _, m := range members {
		names = append(names, m.Name)
	}
	return names
}

// release ends the fill: it gives back the chunk buffers of requests it
// will not handle, and its hold on the origin role, which peers keep
// seeing for OriginLinger, until the blob is committed and its state says
// complete.
func (f *plan) release() {
	if f.released {
		return
	}
	f.released = true
	f.s.fills.Add(-1)
	f.s.buffered.Add(-f.buffered) // requests that will not be handled
	f.buffered = 0
	if f.originRole && f.originShown {
		f.s.setOrigin(f.d, false, f.s.cfg.OriginLinger)
	}
}

// useOrigin reports whether a request to the origin may start now: once
// peers see this node fetch (show). One that took the role at its turn is
// seen only once it has heard from the nodes ranked above it that may
// have taken the role too (rivalsHeard); it then yields before the origin
// sends it a byte, and its peers never split the chunks with it.
func (f *plan) useOrigin() bool {
	return f.originRole && f.originShown && f.originInflight < min(f.originRequests(), f.maxInFlight) &&
		f.s.cfg.Now().After(f.originPause)
}

// rivalsHeard reports whether a node that took the origin role at its turn
// has waited long enough for word of rivals: a quarter of Settle, and until
// each followed peer ranked above it has answered a state read sent after
// it took the role. A timed wait alone is not enough: on a busy node,
// state answers lag by more than Settle. A rival that does not answer
// holds it up for one state read's wait at most.
func (f *plan) rivalsHeard(now time.Time) bool {
	waited := now.Sub(f.originSince)
	if waited < f.s.cfg.Settle/4 {
		return false
	}
	if waited >= f.s.cfg.Settle/4+stateWait {
		return true
	}
	f.rivals = slices.DeleteFunc(f.rivals, func(name string) bool {
		return f.peers.get(name) == nil || f.s.Banned(name) || f.heardSince(name, f.originSince)
	})
	return len(f.rivals) == 0
}

// heardSince reports whether word of peer came from a state read sent at
// t or later: its state, that it holds none, or an error (a peer that does
// not answer, killed but not yet out of the membership, fetches nothing
// for the cluster).
func (f *plan) heardSince(peer string, t time.Time) bool {
	if pv := f.peers.get(peer); pv != nil {
		return !pv.heardAt.Before(t)
	}
	at, absent := f.absent[peer]
	return absent && !at.Before(t)
}

// originShare is this node's share of the origin fetch: the chunks i with
// i%len(fetchers) == share, where fetchers are the origin fetchers this
// node knows of, itself included, in rendezvous order (share j is
// fetchers[j]'s), and share is its place among them. Each chunk then
// leaves the origin once, and each fetcher's upload, which must pass on
// every chunk it fetches, carries only its share: one fetcher alone would
// have to upload as fast as the origin sends, and the swarm would lag it
// by whatever it lost.
func (f *plan) originShare() (share int, fetchers []string) {
	local := f.s.dir.LocalName()
	fetching, candidates := []string{local}, []string{local}
	for _, pv := range f.peers.all() {
		name := pv.name
		if f.s.Banned(name) {
			continue
		}
		candidates = append(candidates, name)
		if pv.known && pv.state.Origin {
			fetching = append(fetching, name)
		}
	}
	// Right after taking the role, the nodes that took it within Settle
	// of it (the first in rendezvous order) may not have said so yet
	// (mayTakeOrigin).
	if waited := f.s.cfg.Now().Sub(f.originSince); waited < f.holdersWait()+stateWait {
		if f.originAtOnce {
			// It did not wait to learn who wants the blob: the other
			// first members may, and not be followed yet.
			candidates = slices.DeleteFunc(f.withMembers(f.s.dir.Members()), f.s.Banned)
		}
		for _, name := range f.electionOrder(candidates)[:min(len(candidates), f.s.cfg.OriginFetchers)] {
			if !slices.Contains(fetching, name) && f.mayTakeOrigin(name, waited) {
				fetching = append(fetching, name)
			}
		}
	}
	order := rendezvous(f.d, fetching)
	return slices.Index(order, local), order
}

// mayTakeOrigin reports whether name, ranked among the first candidates
// and not seen fetching, may still take the origin role, waited after
// this node took it: it counts for Settle, and then until word from it
// sent after that says otherwise, within a state read's wait. Word, not
// time alone: on a busy node state answers lag by more than Settle, and a
// fetcher dropped from the split before its word arrives has its chunks
// fetched twice. Word that it fills the blob but has not taken the role
// yet is no such word while it may wait on the holders it has not heard
// (decideOrigin's holdersWait).
func (f *plan) mayTakeOrigin(name string, waited time.Duration) bool {
	settle := f.s.cfg.Settle
	if waited < settle {
		return true
	}
	if !f.heardSince(name, f.originSince.Add(settle)) {
		return waited < settle+stateWait
	}
	pv := f.peers.get(name)
	return pv != nil && pv.known && !pv.silent && !pv.state.Complete && waited < f.holdersWait()+stateWait
}

// holdersWait is how long decideOrigin waits, past a node's turn, to read
// the state of every holder gossip names: one of them may fetch the blob
// already, or hold it whole.
func (f *plan) holdersWait() time.Duration { return 5 * f.s.cfg.Settle }

// nextFromOrigin is the chunk this node fetches next from the origin, or
// -1: the lowest missing chunk of its origin share that it has not in
// flight and no known peer has or is receiving, so the origin
// fetchers extend the swarm's prefix in order. With its own share done, it
// helps the others: the highest such chunk of another share. A fetcher
// whose downlink carries more flows falls behind, and the origin's link,
// which every node waits on, would send the rest of its share at a
// fraction of its rate.
// The owner works from the front of its share and the helper from the
// back, each skipping what the other says it fetches, so they meet without
// fetching a chunk twice. While a reader waits on the blob in order, a
// fetcher ahead helps from the front instead (helpThePrefix).
func (f *plan) nextFromOrigin(missing []int) int {
	share, fetchers := f.originShare()
	// It helps only fetchers it follows: it sees what they have and fetch.
	followed := make([]bool, len(fetchers))
	for j, name := range fetchers {
		pv := f.peers.get(name)
		followed[j] = pv != nil && pv.known && pv.state.Origin
	}
	untaken := make([][]int, len(fetchers)) // each share's chunks no node has or fetches
	for _, i := range missing {
		j := i % len(fetchers)
		if f.inflight[i] != 0 || (j != share && !followed[j]) {
			continue
		}
		taken := false
		for _, pv := range f.peers.all() {
			if pv.known && (pv.state.Has(i) || pv.state.IsFetching(i)) && !f.s.Banned(pv.name) {
				taken = true
				break
			}
		}
		if !taken {
			untaken[j] = append(untaken[j], i)
		} else {
			delete(f.leftSince, i)
		}
	}
	if i := f.helpThePrefix(untaken, share, fetchers); i >= 0 {
		return i
	}
	if len(untaken[share]) > 0 {
		return slices.Min(untaken[share])
	}
	if i := f.unfetched(untaken, share, fetchers); i >= 0 {
		return i
	}
	// Help the fetcher with the most left, but leave it what it may ask
	// for before word of this node's request reaches it (leaveTo). Where
	// the origin sends a chunk much sooner than a state lag, helping
	// would fetch chunks twice, and a lagging share costs little.
	if f.originTime <= 0 {
		return -1
	}
	behind := -1
	for j, left := range untaken {
		if j != share && len(left) > f.leaveTo(fetchers[j]) && (behind < 0 || len(left) > len(untaken[behind])) {
			behind = j
		}
	}
	if behind < 0 {
		return -1
	}
	return slices.Max(untaken[behind])
}

// helpThePrefix is, while a reader waits on the blob in order (the
// registry mirror's stream to containerd), the earliest untaken chunk of
// another fetcher's share that comes before this node's own next one, past
// those left to that fetcher (leaveTo); or -1. The shares interleave, so
// the prefix the reader follows moves at the slower fetcher's pace, and
// the reader is left most of the blob to read after the fill's end
// (docs/swarm-tuning.md).
func (f *plan) helpThePrefix(untaken [][]int, share int, fetchers []string) int {
	if f.want == nil || f.want.Load() < 0 || f.originTime <= 0 {
		return -1
	}
	own := math.MaxInt
	if len(untaken[share]) > 0 {
		own = slices.Min(untaken[share])
	}
	best := -1
	for j, left := range untaken {
		if j == share || len(left) == 0 {
			continue
		}
		slices.Sort(left)
		if k := f.leaveTo(fetchers[j]); k < len(left) && left[k] < own && (best < 0 || left[k] < best) {
			best = left[k]
		}
	}
	return best
}

// unfetched is the highest chunk of another fetcher's share that this
// node, its own share done, left to that fetcher, and that word from it
// shows it neither has nor fetches, word sent leftWait after the chunk was
// left (or a state lag and a chunk time per chunk left and two more, if
// longer); or -1. Fetchers that see different sets of fetchers (a ban, a
// slow gossip) split the chunks differently, and a chunk each thinks the
// other's would wait until the sets agree.
func (f *plan) unfetched(untaken [][]int, share int, fetchers []string) int {
	now, found := f.s.cfg.Now(), -1
	if f.leftSince == nil {
		f.leftSince = map[int]time.Time{}
	}
	for j, left := range untaken {
		if j == share || len(left) == 0 {
			continue // only a followed fetcher's share has untaken chunks
		}
		wait := max(leftWait, f.stateLag()+time.Duration(2+len(left))*max(f.fetcherChunkTime(f.peers.get(fetchers[j])), f.originTime))
		for _, i := range left {
			since, seen := f.leftSince[i]
			if !seen {
				f.leftSince[i] = now
			} else if i > found && f.heardSince(fetchers[j], since.Add(wait)) {
				found = i
			}
		}
	}
	return found
}

// leftWait is the least time unfetched gives a fetcher to start a chunk it
// was left. Its next chunks wait on its requests in flight, an origin's
// answers and its backoff: under load, a fetcher left a chunk had not
// started it after four of its chunk times, and taking it was a second
// copy from the origin. A hole in the split waited minutes.
const leftWait = 5 * time.Second

// farSlower is how many times longer than this node's origin requests a
// helped fetcher's chunks must take it for the helper to leave it only
// what it starts within a state lag.
const farSlower = 4

// leaveTo is how many of fetcher's untaken chunks a helper leaves it: its
// requests in flight, again for each origin chunk time in stateLag, as
// many as it may start before word of the helper's request reaches it.
// One far slower (a slow downlink) starts its next requests many seconds
// apart, and would take what it is left at its pace while every node
// waits: it is left what it starts within a state lag, most often none.
// Only one slower than word of a request travels: helping a quicker one
// would fetch chunks twice.
func (f *plan) leaveTo(fetcher string) int {
	n := f.originRequests()
	if pv := f.peers.get(fetcher); pv != nil && f.fetcherChunkTime(pv) > max(farSlower*f.originTime, f.stateLag()) {
		return int(math.Round(f.stateLag().Seconds() / pv.chunkEvery.Seconds()))
	}
	return n * (1 + int(f.stateLag()/f.originTime))
}

// fetcherChunkTime is how long a chunk takes origin fetcher pv, as its
// states show it, with as many requests in flight as this node keeps: the
// measure of this node's originTime.
func (f *plan) fetcherChunkTime(pv *peerView) time.Duration {
	return time.Duration(f.originRequests()) * pv.chunkEvery
}

// stateLag bounds how long word of a request takes from one origin
// fetcher to another and back: each reads the other's state at most once
// per Refresh, and a server looks for news every statePoll.
func (f *plan) stateLag() time.Duration {
	return 2 * (f.s.cfg.Refresh + statePoll)
}

// originRequests is how many requests an origin fetcher keeps in flight to
// the origin for this fill: SwarmConfig.OriginInFlight where set, else 3
// while it is the node's only fill and 2 while the node runs others. At
// the start of a fill the chunks in flight from the origin are all its
// peers can relay, each from a holder that splits its upload among its
// slots: with one blob, OriginFetchers × 3 of them give a node as many
// transfers as a holder has slots, and three also give the origin about
// the share of a fetcher's downlink it needs beside fetcherPeerRequests.
// Fills of several blobs at once (an image's layers) have more chunks in
// flight already, and there a third request made each slower and the
// pull longer (docs/swarm-tuning.md).
func (f *plan) originRequests() int {
	if n := f.s.cfg.OriginInFlight; n > 0 {
		return n
	}
	if !f.s.severalFills() {
		return 3
	}
	return 2
}

// fetcherPeerRequests bounds an origin fetcher's requests to peers while it
// still has chunks to fetch from the origin. Its downlink carries both, and
// TCP shares a link about evenly among its flows: more peer requests starve
// the origin flows the whole swarm waits on, fewer starve the fetcher's own
// download from peers (measurements in docs/swarm-tuning.md).
const fetcherPeerRequests = 4

// mayAskPeers reports whether another request may go to a peer, total
// being the requests in flight: not while this node is an origin fetcher
// with origin work left and fetcherPeerRequests already out to peers.
func (f *plan) mayAskPeers(total int, missing []int) bool {
	if !f.originRole || total-f.originInflight < fetcherPeerRequests {
		return true
	}
	return f.originInflight == 0 && f.nextFromOrigin(missing) < 0
}

// Origin failures the download tolerates: it gives up only after
// originGiveUp failures in a row and originPatience without a byte from
// the origin. The origin is not a peer: there is no other to turn to, and
// a registry whose link is shared by many pulls is slow, not gone.
const (
	originGiveUp   = 5
	originPatience = 30 * time.Second
	originMaxPause = 5 * time.Second
)

// originFailed books a failed origin request. A slow answer (some bytes,
// then a stall) is not a failure: the origin answers, its link is
// busy. Other failures back off, doubling up to originMaxPause.
func (f *plan) originFailed(r chunkResult) error {
	if errors.Is(r.err, content.ErrPermanent) {
		return fmt.Errorf("origin: %w", r.err)
	}
	now := f.s.cfg.Now()
	if errors.Is(r.err, errSlow) {
		f.originHeard = now
		f.s.log.Debug("origin chunk too slow; asking again", "digest", f.d, "chunk", r.chunk, "err", r.err)
		return nil
	}
	f.originFailures++
	if f.originFailures >= originGiveUp && now.Sub(f.originHeard) >= originPatience {
		return fmt.Errorf("origin failed %d times in a row, and sent nothing for %s: %w",
			f.originFailures, now.Sub(f.originHeard).Round(time.Second), r.err)
	}
	f.originPause = now.Add(min(originMaxPause, 200*time.Millisecond<<min(f.originFailures-1, 5)))
	f.s.log.Warn("origin chunk failed; retrying", "digest", f.d, "chunk", r.chunk, "failures", f.originFailures, "err", r.err)
	return nil
}
