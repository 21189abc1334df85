package p2p

import (
	"encoding/base64"
	"fmt"
	"math/bits"
	"net/http"
	"strconv"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// serveState answers with the blob's state. With "?since=K&wait=D" it first
// waits, up to D (at most 2 s), until this node has more than K chunks of the
// blob or holds it whole, or (with "&sent=J") until it has sent other than J
// of them, or (with "&fetching=F", which also asks for the bitmap of chunks
// on their way here) until other than F are on their way, or (with
// "&origin=0|1") until its origin role differs: peers learn of each
// verified chunk, each first send and each chunk on its way within
// milliseconds without polling in a tight loop. With "&known=B"
// (the bitmap of chunks whose hashes the requester has, base64url) it
// leaves those hashes out.
func (s *ChunkServer) serveState(w http.ResponseWriter, r *http.Request) {
	d, err := content.ParseDigest(r.PathValue("digest"))
	if err != nil {
		s.fail(w, "state", http.StatusBadRequest, err)
		return
	}
	since, wait := -1, time.Duration(0)
	if v := r.URL.Query().Get("since"); v != "" {
		if since, err = strconv.Atoi(v); err != nil || since < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("since %q", v))
			return
		}
	}
	if v := r.URL.Query().Get("wait"); v != "" {
		if wait, err = time.ParseDuration(v); err != nil || wait < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("wait %q", v))
			return
		}
	}
	knownSent := -1
	if v := r.URL.Query().Get("sent"); v != "" {
		if knownSent, err = strconv.Atoi(v); err != nil || knownSent < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("sent %q", v))
			return
		}
	}
	knownFetching := -1
	if v := r.URL.Query().Get("fetching"); v != "" {
		if knownFetching, err = strconv.Atoi(v); err != nil || knownFetching < 0 {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("fetching %q", v))
			return
		}
	}
	knownOrigin := r.URL.Query().Get("origin")
	var knownHashes []byte
	if v := r.URL.Query().Get("known"); v != "" {
		if knownHashes, err = base64.RawURLEncoding.DecodeString(v); err != nil {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("known %q", v))
			return
		}
	}
	q := stateQuery{since: since, sent: knownSent, fetching: knownFetching, origin: knownOrigin}
	if wait > 0 {
		ok, done := s.mayWait(peerOf(r))
		defer done()
		if !ok {
			wait = 0 // it has enough requests waiting: this one is answered now
		}
	}
	deadline := time.Now().Add(min(wait, maxStateWait))
	var have []byte // each look's bitmap, the next one's buffer
	var tick *time.Ticker
	for time.Now().Before(deadline) {
		var news bool
		if news, have = s.news(d, q, have); news {
			break
		}
		if tick == nil {
			tick = time.NewTicker(statePoll)
			defer tick.Stop()
		}
		select {
		case <-r.Context().Done():
			return
		case <-tick.C:
		}
	}
	st, err := s.store.ChunkState(d)
	if err != nil {
		s.fail(w, "state", statusOf(err), err)
		return
	}
	origin := s.originRole(d)
	sent := s.sent.get(d, st.Have)
	var fetching []byte
	if knownFetching >= 0 {
		// Only to those who ask: agents that predate the fetching
		// bitmap reject a state that has one.
		fetching = notHeld(s.receiving(d), st.Have)
	}
	var known []byte
	if knownHashes != nil {
		if len(knownHashes) != len(st.Have) {
			s.fail(w, "state", http.StatusBadRequest, fmt.Errorf("known: %d bytes for %d chunks", len(knownHashes), chunksOf(st.Size, st.ChunkSize)))
			return
		}
		known = intersect(knownHashes, st.Have)
	}
	b := EncodePeerState(PeerState{ChunkState: st, Origin: origin, Sent: sent, Fetching: fetching, Known: known})
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	s.m.requests.WithLabelValues("state", "200").Inc()
	extendWrite(w) // it may have waited
	if _, err := w.Write(b); err != nil {
		s.log.Debug("sending a chunk state", "digest", d, "err", err)
	}
}

// stateQuery is what a state request knows of a blob already; it waits
// for news beyond it. -1 (or "" for origin) where it did not say.
type stateQuery struct {
	since, sent, fetching int
	origin                string
}

// news reports whether this node's state of d differs from what q knows:
// more chunks, the blob complete, other chunks sent (sent) or on their
// way here (fetching), the origin role taken or given up. It copies no
// hash where the store can tell without (chunkMapper), which the server
// asks every statePoll while a request waits; buf is scratch for the
// bitmap, returned for the next look. An error is no news: the blob may
// yet come.
func (s *ChunkServer) news(d digest.Digest, q stateQuery, buf []byte) (bool, []byte) {
	var have []byte
	var complete bool
	var err error
	if m, ok := s.store.(chunkMapper); ok {
		if have, complete, err = m.ChunkMap(d, buf); have != nil {
			buf = have
		}
	} else {
		var st cache.ChunkState
		st, err = s.store.ChunkState(d)
		have, complete = st.Have, st.Complete
	}
	switch {
	case err != nil:
		return false, buf
	case complete || countBits(have) > q.since:
		return true, buf
	case q.sent >= 0 && s.sent.count(d, have) != q.sent:
		return true, buf
	case q.fetching >= 0 && s.countReceiving(d, have) != q.fetching:
		return true, buf
	}
	return q.origin != "" && (q.origin == "1") != s.originRole(d), buf
}

func countBits(b []byte) int {
	n := 0
	for _, x := range b {
		n += bits.OnesCount8(x)
	}
	return n
}
