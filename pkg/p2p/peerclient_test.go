package p2p

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// stallingPeer serves any chunk as n bytes long, sends the first sent of
// them and then nothing more; it returns the server's address.
func stallingPeer(t *testing.T, n, sent int) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(n))
		_, _ = w.Write(make([]byte, sent))
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// A peer whose upload is shared by many sends a chunk slowly: it is asked
// less for a while, never banned as failing; a peer that sends nothing is.
func TestSlowPeerIsNotBannedAsFailing(t *testing.T) {
	t.Parallel()
	const n = 1 << 20
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	d := descOf(randomBlob(16, n)).Digest
	_, err = s.fetchChunk(context.Background(), stallingPeer(t, n, 64<<10), d, 0, 300*time.Millisecond, false, false, newLiveChunk(n))
	require.ErrorIs(t, err, errSlow)

	f := &plan{s: s, d: d, inflight: map[int]int{}, peers: peersOf(&peerView{name: "slow"}, &peerView{name: "dead"})}
	for range 3 {
		for name, e := range map[string]error{"slow": err, "dead": errors.New("connection refused")} {
			f.inflight[0]++
			f.peers.get(name).inflight++
			require.NoError(t, f.handle(chunkResult{chunk: 0, peer: name, err: e}))
		}
	}
	require.False(t, s.Banned("slow"))
	require.True(t, f.peers.get("slow").busyTill.After(time.Now()), "a slow peer is asked less for a while")
	require.True(t, s.Banned("dead"))

	// A relay's chunk that fails on its way to it is not the relay's
	// fault; a relay that cannot be reached is failing.
	f.peers.add(&peerView{name: "relay", chunkBusy: map[int]time.Time{}})
	f.peers.add(&peerView{name: "gone", chunkBusy: map[int]time.Time{}})
	for range 3 {
		for name, e := range map[string]error{"relay": fmt.Errorf("%w: %w", errRelayCut, io.ErrUnexpectedEOF), "gone": errors.New("connection refused")} {
			f.inflight[0]++
			f.peers.get(name).inflight++
			require.NoError(t, f.handle(chunkResult{chunk: 0, peer: name, relay: true, err: e}))
		}
	}
	require.False(t, s.Banned("relay"))
	require.True(t, f.peers.get("relay").chunkBusy[0].After(time.Now()), "asked for another chunk meanwhile")
	require.True(t, s.Banned("gone"))
}

// tricklingPeer serves any chunk as n bytes long, a piece every tick.
func tricklingPeer(t *testing.T, n, piece int, tick time.Duration) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", fmt.Sprint(n))
		for sent := 0; sent < n; sent += piece {
			if _, err := w.Write(make([]byte, min(piece, n-sent))); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-time.After(tick):
			case <-r.Context().Done():
				return
			}
		}
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// A copy that comes at under a sixteenth of this node's downlink is given
// up once it has had slowCopyAfter to show its pace, as slow (the peer is
// asked less for a while, not banned); an origin fetcher's copy (slowEnds
// false) is waited for. The clock runs 20 times as fast as the trickle.
func TestTooSlowCopyIsGivenUp(t *testing.T) {
	t.Parallel()
	const n, piece, tick = 1 << 20, 64 << 10, 25 * time.Millisecond
	for _, slowEnds := range []bool{true, false} {
		t.Run(fmt.Sprint("slowEnds=", slowEnds), func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			fast := func() time.Time { return start.Add(20 * time.Since(start)) }
			s, err := NewSwarm(nil, nil, SwarmConfig{Now: fast}, nil, nil)
			require.NoError(t, err)
			// As if it had received at 1 GiB/s lately: the trickle, 2.6 MB/s
			// at the clock's pace 131 KB/s, is far under a sixteenth of it.
			s.downlink = paceMeter{at: fast(), peak: 1 << 30}
			d := descOf(randomBlob(19, n)).Digest
			_, err = s.fetchChunk(context.Background(), tricklingPeer(t, n, piece, tick), d, 0, time.Hour, slowEnds, false, newLiveChunk(n))
			if !slowEnds {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, errSlow)
			require.NotErrorIs(t, err, errStalled)
		})
	}
}

// A request's deadline gives each of the node's fills the slowest
// acceptable rate: with four blobs filling at once, a copy comes at a
// quarter of the pace it would alone, and a deadline for one fill ended
// copies that were nearly whole.
func TestRequestDeadlineGrowsWithTheFills(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{MinRate: 1 << 20}, nil, nil)
	require.NoError(t, err)
	s.fills.Store(1)
	require.Equal(t, 5*time.Second+2*time.Second, s.requestTimeout(2<<20, false))
	s.fills.Store(4)
	require.Equal(t, 5*time.Second+8*time.Second, s.requestTimeout(2<<20, false))
	s.fills.Store(0) // a small blob fetched outside any fill
	require.Equal(t, 5*time.Second+2*time.Second, s.requestTimeout(2<<20, false))
}

// A relayed copy comes at its relay's upstream pace, down to the origin's
// pace for a chunk still on its way from there: its deadline is
// relayDeadlines times a whole chunk's, and still bounded, so that a peer
// cannot hold a request by trickling bytes.
func TestRelayedCopyHasALongerDeadline(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{MinRate: 1 << 20}, nil, nil)
	require.NoError(t, err)
	s.fills.Store(2)
	whole := s.requestTimeout(2<<20, false)
	require.Equal(t, 5*time.Second+4*time.Second, whole)
	require.Equal(t, relayDeadlines*whole, s.requestTimeout(2<<20, true))
	require.Greater(t, relayDeadlines, 1)
}

// A transfer ends once no byte has come for stallTimeout, long before its
// deadline: as slow when some bytes came, as failed when none did.
func TestStalledTransferEndsEarly(t *testing.T) {
	t.Parallel()
	const n = 1 << 20
	for name, sent := range map[string]int{"some bytes": 64 << 10, "no bytes": 0} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
			require.NoError(t, err)
			d := descOf(randomBlob(17, n)).Digest
			_, err = s.fetchChunk(context.Background(), stallingPeer(t, n, sent), d, 0, time.Hour, false, false, newLiveChunk(n))
			require.ErrorIs(t, err, errStalled)
			require.Equal(t, sent > 0, errors.Is(err, errSlow), "%v", err)
		})
	}
}

// DownloadLimit paces what a node streams from the origin too (a blob
// read in order, or any blob while it has no peers), not only the
// swarm's chunks: the limiter's bucket holds what was read less its
// refill, one byte a second here.
func TestDownloadLimitPacesOriginStreams(t *testing.T) {
	t.Parallel()
	const n = 256 << 10
	blob := randomBlob(18, n)
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{DownloadLimit: 1}, nil, nil)
	require.NoError(t, err)
	burst := float64(s.download.Burst())
	require.Greater(t, burst, float64(n), "the read fits the bucket: nothing waits")

	r, err := s.Source(descOf(blob), Origin{RangeOpener: memOrigin(blob)}).OpenRange(context.Background(), 0)
	require.NoError(t, err)
	got, err := io.ReadAll(r)
	require.NoError(t, err)
	require.Equal(t, blob, got)
	require.InDelta(t, burst-n, s.download.Tokens(), 60, "the stream through the swarm's source took its bytes from the limit")
}
