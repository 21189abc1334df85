package p2p

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/weightd/weightd/pkg/content"
)

// trustedHash is the hash chunk i from peer from must have: the one an
// origin fetcher other than from advertises if any does (it hashed the
// origin's bytes), else own, from's. A peer that disagrees with an origin
// fetcher is lying.
func (f *plan) trustedHash(i int, from string, own []byte) []byte {
	if h := f.fetcherHash(i, from); h != nil {
		if own != nil && !bytes.Equal(h, own) {
			f.s.m.mismatches.Inc()
		}
		return h
	}
	return own
}

// fetcherHash is the hash of chunk i that an origin fetcher other than
// from advertises, or nil.
func (f *plan) fetcherHash(i int, from string) []byte {
	for _, pv := range f.peers.all() {
		if pv.state.Origin && pv.known && pv.name != from {
			if h := pv.state.Hash(i); h != nil {
				return h
			}
		}
	}
	return nil
}

// followsFetcher reports whether this download follows an origin fetcher
// other than from.
func (f *plan) followsFetcher(from string) bool {
	for _, pv := range f.peers.all() {
		if pv.state.Origin && pv.known && pv.name != from && !f.s.Banned(pv.name) {
			return true
		}
	}
	return false
}

// hashQuery asks the download's loop which hash chunk i, relayed by peer
// from, must have; claim is from's own word, sent after the bytes.
type hashQuery struct {
	chunk int
	from  string
	claim []byte
	since time.Time
	reply chan []byte // nil: no hash can be trusted
}

// hashWait bounds how long a relayed chunk waits for word of its hash
// from an origin fetcher before it takes the relay's: the fetcher
// verified the chunk before the relay could, and its state says so within
// milliseconds, unless the fetcher is gone.
const hashWait = time.Second

var errNoHash = errors.New("no hash to check the chunk against")

// askHash waits for the loop's answer to a hashQuery.
func (f *fill) askHash(ctx context.Context, i int, from string, claim []byte) ([]byte, error) {
	q := hashQuery{chunk: i, from: from, claim: claim, since: f.s.cfg.Now(), reply: make(chan []byte, 1)}
	select {
	case f.hashQueries <- q:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case h := <-q.reply:
		if h == nil {
			return nil, errNoHash
		}
		return h, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// answerHashes answers the hash queries it can: with another origin
// fetcher's hash, else the relay's own word. Less than hashWait after the
// query it waits instead while the relay's word is still to come in its
// state (it had verified the chunk when asked, and sent it whole, without
// a trailer), or while the relay is not an origin fetcher itself and an
// origin fetcher is followed: that one's word is due. (With none, the blob
// is one a peer holds whole, or its fetchers are done or gone.)
func (f *fill) answerHashes() {
	now := f.s.cfg.Now()
	waiting := f.hashWaits[:0]
	for _, q := range f.hashWaits {
		pv := f.peers.get(q.from)
		claim := q.claim
		if claim == nil && pv != nil {
			claim = pv.state.Hash(q.chunk)
		}
		fromFetcher := pv != nil && pv.state.Origin
		h := f.fetcherHash(q.chunk, q.from)
		if h == nil && now.Sub(q.since) < hashWait && (claim == nil || (!fromFetcher && f.followsFetcher(q.from))) {
			waiting = append(waiting, q)
			continue
		}
		q.reply <- f.trustedHash(q.chunk, q.from, claim)
	}
	clear(f.hashWaits[len(waiting):])
	f.hashWaits = waiting
}

// verify checks the whole blob; if a wrong chunk map let bad chunks in, it
// refetches the chunks that came from peers from the origin, bans the peers
// whose chunks differ, and checks again.
func (f *fill) verify(ctx context.Context) error {
	err := f.p.Verify()
	if !errors.Is(err, content.ErrDigestMismatch) {
		return err
	}
	f.s.log.Warn("blob from the swarm failed verification; repairing from the origin", "digest", f.d)
	blamed := map[string]bool{}
	for i := range f.p.Chunks() {
		peer, fromPeer := f.supplier[i]
		if !fromPeer || peer == "" {
			continue
		}
		err := f.repair(ctx, i, func() {
			if !blamed[peer] {
				blamed[peer] = true
				f.s.m.mismatches.Inc()
				f.s.ban(peer, "wrong_chunk_map")
			}
		})
		if err != nil {
			return fmt.Errorf("repairing chunk %d of %s from the origin: %w", i, f.d, err)
		}
		f.supplier[i] = ""
	}
	return f.p.Verify()
}

// repair fetches chunk i from the origin and, if it differs from what is
// stored, calls blame and replaces it.
func (f *fill) repair(ctx context.Context, i int, blame func()) error {
	c := newLiveChunk(f.p.ChunkLen(i))
	defer c.release()
	if err := f.s.fetchOrigin(ctx, f.origin, int64(i)*f.p.ChunkSize(), c); err != nil {
		return err
	}
	sum := sha256.Sum256(c.data())
	if bytes.Equal(sum[:], f.p.Hash(i)) {
		return nil
	}
	blame()
	f.p.Invalidate(i)
	return f.p.WriteChunk(i, c.data(), nil)
}
