package p2p

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fromHost is a client whose connections leave from ip (a loopback
// address), so that a chunk server tells its requests apart by host as it
// tells members apart.
func fromHost(t *testing.T, ip string) *http.Client {
	t.Helper()
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	tr := &http.Transport{DialContext: dialer.DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// originFetcherAsked serves a blob of one chunk as its origin fetcher, to
// members a, b and c on 127.0.0.2–4, and returns how to ask it for the
// chunk from a host, asking it to send again or not.
func originFetcherAsked(t *testing.T, seed uint64) func(ip string, again bool) *http.Response {
	t.Helper()
	data := randomBlob(seed, testChunk)
	d := descOf(data).Digest
	dir := staticDir{local: "fetcher", peers: map[string]Peer{
		"a": {Name: "a", Meta: NodeMeta{ChunkAddr: "127.0.0.2:4000"}},
		"b": {Name: "b", Meta: NodeMeta{ChunkAddr: "127.0.0.3:4000"}},
		"c": {Name: "c", Meta: NodeMeta{ChunkAddr: "127.0.0.4:4000"}},
	}}
	sw, err := NewSwarm(dir, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	sw.setOrigin(d, true, 0)
	_, ts := serveStore(t, storeHolding(t, data), WithSwarm(sw))
	url := ts.URL + fmt.Sprintf(chunkPath, d, 0)
	return func(ip string, again bool) *http.Response {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		require.NoError(t, err)
		if again {
			req.Header.Set(sendAgainHeader, "1")
		}
		resp, err := fromHost(t, ip).Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
}

// An origin fetcher that refuses a chunk it sent once names the member it
// sent it to; asked again by one that found that member no source, it
// sends it, and names the new receiver after that.
func TestOriginFetcherNamesItsReceiver(t *testing.T) {
	t.Parallel()
	ask := originFetcherAsked(t, 8)
	require.Equal(t, http.StatusOK, ask("127.0.0.2", false).StatusCode, "the first send, to a")
	refused := ask("127.0.0.3", false)
	require.Equal(t, http.StatusServiceUnavailable, refused.StatusCode)
	require.Equal(t, "chunk", refused.Header.Get(busyHeader))
	require.Equal(t, "a", refused.Header.Get(sentToHeader))
	require.Equal(t, "a", ask("127.0.0.9", false).Header.Get(sentToHeader), "any asker hears the receiver")
	require.Equal(t, http.StatusOK, ask("127.0.0.3", true).StatusCode, "a proved no source to b: sent again, to b")
	require.Equal(t, "b", ask("127.0.0.2", false).Header.Get(sentToHeader))
}

// A chunk server's refusal that names a receiver reaches the fill as a
// sentToError, still errChunkBusy to all that test for it; a request to
// send again carries sendAgainHeader.
func TestFetchChunkHearsTheReceiver(t *testing.T) {
	t.Parallel()
	var asked []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked = append(asked, r.Header.Get(sendAgainHeader))
		w.Header().Set(busyHeader, "chunk")
		w.Header().Set(sentToHeader, "node-007")
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(srv.Close)
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	d := descOf(randomBlob(9, testChunk)).Digest
	addr := strings.TrimPrefix(srv.URL, "http://")
	_, err = s.fetchChunk(context.Background(), addr, d, 0, time.Minute, false, false, newLiveChunk(testChunk))
	var to *sentToError
	require.ErrorAs(t, err, &to)
	require.Equal(t, "node-007", to.peer)
	require.ErrorIs(t, err, errChunkBusy)
	_, err = s.fetchChunk(context.Background(), addr, d, 0, time.Minute, false, true, newLiveChunk(testChunk))
	require.True(t, errors.Is(err, errChunkBusy))
	require.Equal(t, []string{"", "1"}, asked)
}

// A fill refused a chunk by an origin fetcher that names its receiver
// follows the receiver and reads its state at the next pass; where the
// receiver is banned here, or no member, it asks the fetcher to send it
// again, once.
func TestRefusedFillMeetsTheReceiver(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)
	dir := clusterOf([]string{"me", "node-000", "node-001", "node-002"})
	s, err := NewSwarm(dir, nil, SwarmConfig{Now: func() time.Time { return now }}, nil, nil)
	require.NoError(t, err)
	f := s.newPlan(descOf(randomBlob(1, 4*testChunk)), testChunk, nil)
	f.addPeer("node-000", now)
	fetcher := f.peers.get("node-000")
	refuse := func(chunk int, receiver string) {
		req := f.book(chunk, fetcher)
		require.False(t, req.again)
		require.NoError(t, f.handle(chunkResult{chunk: chunk, peer: "node-000", err: &sentToError{peer: receiver}}))
	}

	refuse(0, "node-001")
	receiver := f.peers.get("node-001")
	require.NotNil(t, receiver, "the receiver is followed")
	require.True(t, receiver.readAt.IsZero() && !receiver.reading, "and read at the next pass")
	require.False(t, fetcher.sendAgain[0])

	s.ban("node-002", "corrupt_chunk")
	refuse(1, "node-002")
	require.Nil(t, f.peers.get("node-002"), "a banned receiver is not followed")
	refuse(2, "not-a-member")
	require.Nil(t, f.peers.get("not-a-member"))
	require.True(t, f.book(1, fetcher).again, "asked to send it again")
	require.False(t, f.book(1, fetcher).again, "once")
	require.True(t, f.book(2, fetcher).again)

	// Refused again (the fetcher sent it again as often as it will): the
	// fill waits a Refresh before it asks that fetcher for the chunk, not
	// a round trip.
	require.NoError(t, f.handle(chunkResult{chunk: 2, peer: "node-000", again: true, err: &sentToError{peer: "not-a-member"}}))
	require.False(t, fetcher.sendAgain[2])
	require.Equal(t, now.Add(f.refreshEvery()), fetcher.chunkBusy[2])
}

// Whatever a fetcher names as its receiver, a fill follows only a member
// other than itself.
func FuzzMeetReceiver(f *testing.F) {
	for _, seed := range []string{"node-001", "", "me", "node-001\x00", strings.Repeat("n", 300)} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, name string) {
		s, err := NewSwarm(manyHolders(2, 0), nil, SwarmConfig{}, nil, nil)
		require.NoError(t, err)
		p := s.newPlan(descOf(randomBlob(1, testChunk)), testChunk, nil)
		met := p.meetReceiver(name)
		_, member := s.dir.Peer(name)
		require.Equal(t, member && name != "me", met)
		require.Equal(t, met, p.peers.get(name) != nil)
	})
}

// Attack: an asker that claims the receiver failed draws another copy of
// the chunk from the origin fetcher's upload, the swarm's narrowest pipe.
// Only a member other than the receiver may claim it, and a chunk is sent
// again at most maxSendsAgain times in its window, however many members
// take turns to claim it.
func TestSendAgainIsBounded(t *testing.T) {
	t.Parallel()
	ask := originFetcherAsked(t, 10)
	require.Equal(t, http.StatusOK, ask("127.0.0.2", false).StatusCode, "the first send, to a")
	require.Equal(t, http.StatusServiceUnavailable, ask("127.0.0.9", true).StatusCode, "no member: not sent again")
	require.Equal(t, http.StatusServiceUnavailable, ask("127.0.0.2", true).StatusCode, "the receiver cannot claim itself failed")
	sent := 0
	for turn := range 10 {
		if ask([]string{"127.0.0.3", "127.0.0.4"}[turn%2], true).StatusCode == http.StatusOK {
			sent++
		}
	}
	require.Equal(t, maxSendsAgain, sent, "b and c taking turns")
}

// Attack: whoever reaches the chunk server first for a chunk of the origin
// fetcher's share was its one receiver for resendAfter. A pod on a cluster
// without TLS between peers, no member, could ask for every chunk first and
// hold the members' fill off for 10 s a chunk. A send to a non-member is
// no send the swarm can follow: it opens no window.
func TestNonMemberOpensNoSendOnceWindow(t *testing.T) {
	t.Parallel()
	ask := originFetcherAsked(t, 11)
	require.Equal(t, http.StatusOK, ask("127.0.0.9", false).StatusCode, "no member")
	require.Equal(t, http.StatusOK, ask("127.0.0.2", false).StatusCode, "the first member to ask is the receiver")
	refused := ask("127.0.0.3", false)
	require.Equal(t, http.StatusServiceUnavailable, refused.StatusCode)
	require.Equal(t, "a", refused.Header.Get(sentToHeader))
}
