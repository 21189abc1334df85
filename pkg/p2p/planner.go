package p2p

import (
	"sync/atomic"
	"time"

	"github.com/weightd/weightd/pkg/content"
)

// Planner is one blob's swarm decisions without their I/O: the code a fill
// runs (origin election and shares, rarest-first and wanted-first picking,
// supplier choice, holdoff, endgame, backoff and bans), fed by its caller,
// which reads the holders' states and carries out the requests it decides.
// It lets a simulation (bench/swarmsim) drive the real decisions over a
// simulated network, at a scale no test bed reaches; the swarm's clock
// (SwarmConfig.Now) is then the simulation's. Hashes are not checked
// here: a simulated chunk that would not match ends with
// content.ErrDigestMismatch. Not safe for concurrent use.
type Planner struct {
	f    *plan
	want atomic.Int64
}

// PlanRequest is a request a Planner decided: chunk Chunk from peer Peer,
// or from the origin when Peer is "". Relay says Peer is still receiving
// the chunk: it relays the bytes as they come.
type PlanRequest struct {
	Chunk    int
	Peer     string
	Relay    bool
	SlowEnds bool // the copy is given up if it comes too slowly (CopyTooSlow)
	Again    bool // ask an origin fetcher to send again a chunk it sent once: its receiver proved no source
}

// The chunk server as a simulation models it: a state read waits for news
// at most PlanStateWait, looking for it every PlanStatePoll; an origin
// fetcher sends a chunk once per PlanResendAfter; a relay holds back its
// last PlanRelayPiece bytes until the chunk is verified; a state request
// names the hashes it knows while their bitmap is at most
// PlanMaxKnownParam bytes.
const (
	PlanStateWait     = stateWait
	PlanStatePoll     = statePoll
	PlanResendAfter   = resendAfter
	PlanRelayPiece    = relayPiece
	PlanMaxKnownParam = maxKnownParam
)

// ChunkSentTo is ErrChunkSent from an origin fetcher that names the peer
// it sent the chunk to.
func ChunkSentTo(peer string) error { return &sentToError{peer: peer} }

// Errors a simulated request may end with, as the real ones do: the
// peer's upload slots are all taken; it is an origin fetcher that sent the
// chunk already and leaves it to the receiver to pass on; it holds none
// of the blob (a state read's answer too); it relayed a chunk that failed
// on its way to it; the copy came too slowly (CopyTooSlow).
var (
	ErrPeerBusy  = errBusy
	ErrChunkSent = errChunkBusy
	ErrNotHeld   = errNotHeld
	ErrRelayCut  = errRelayCut
	ErrSlow      = errSlow
)

// Planner starts the decisions of filling the blob desc, in chunks of
// chunkSize, on this swarm (its directory, config, clock and bans).
func (s *Swarm) Planner(desc content.Descriptor, chunkSize int64) *Planner {
	p := &Planner{}
	p.want.Store(-1)
	p.f = s.newPlan(desc, chunkSize, &p.want)
	return p
}

// Want says that a reader of the blob waits on byte off, as the registry
// mirror's stream says it to the swarm's source; -1 for none.
func (p *Planner) Want(off int64) { p.want.Store(off) }

// Step is one pass of a fill's loop: it returns the peers whose chunk
// states to read now (answer each with StateRead) and the requests to
// start (end each with Done). missing is the chunks not held yet; Step
// reorders it.
func (p *Planner) Step(missing []int) (reads []string, reqs []PlanRequest) {
	for _, pv := range p.f.refresh(missing) {
		reads = append(reads, pv.name)
	}
	p.f.decideOrigin()
	for _, r := range p.f.schedule(missing) {
		if r.peer == nil {
			reqs = append(reqs, PlanRequest{Chunk: r.chunk})
			continue
		}
		reqs = append(reqs, PlanRequest{Chunk: r.chunk, Peer: r.peer.name, Relay: !r.peer.state.Has(r.chunk), SlowEnds: r.slowEnds, Again: r.again})
	}
	return reads, reqs
}

// StateRead answers a state read of peer that Step asked for: its state,
// or why it could not be read.
func (p *Planner) StateRead(peer string, st PeerState, err error) {
	p.f.updateState(stateResult{peer: peer, state: st, err: err})
}

// Done ends request r, which took took, with err (nil: the chunk came and
// was verified). It returns an error when the blob cannot be filled
// (the origin failed for good).
func (p *Planner) Done(r PlanRequest, took time.Duration, err error) error {
	if r.Peer != "" {
		p.f.s.requestCounter(r.Peer).Add(-1)
	}
	return p.f.handle(chunkResult{chunk: r.Chunk, peer: r.Peer, relay: r.Relay, again: r.Again, err: err, took: took})
}

// Origin reports whether this node holds the origin role for the blob.
func (p *Planner) Origin() bool { return p.f.originRole }

// Release ends the plan, giving back its chunk buffers and its origin
// role, which peers still see for OriginLinger (Swarm.FetchesFromOrigin).
func (p *Planner) Release() { p.f.release() }
