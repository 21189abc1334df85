package p2p

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
)

func TestSlotsHeld(t *testing.T) {
	t.Parallel()
	const uplink = 12e6 // bytes/s; a slot's share is 2e6, half of it 1e6
	fast := Upload{Sent: 20e6, Running: 10 * time.Second}
	slow := Upload{Sent: 9e6, Running: 10 * time.Second}
	young := Upload{Sent: 0, Running: slotLendAfter / 2}
	for _, tc := range []struct {
		name    string
		uploads []Upload
		uplink  float64
		want    int
	}{
		{"none", nil, uplink, 0},
		{"fast ones hold theirs", []Upload{fast, fast, fast}, uplink, 3},
		{"a slow one lends its slot", []Upload{fast, slow, fast}, uplink, 2},
		{"a young one has not shown its pace", []Upload{young, young}, uplink, 2},
		{"the uplink not measured yet", []Upload{slow, slow}, 0, 2},
		{"at most a slot count lend", []Upload{slow, slow, slow, slow, slow, slow, slow, slow, slow}, uplink, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, SlotsHeld(tc.uploads, tc.uplink, 6))
		})
	}
}

// On a fast uplink a chunk at half a slot's share takes far less than
// slotLendAfter: an upload of it lends its slot once it has run that long
// (a tenth of a second at least), not a second on. On a slow uplink, or
// before its size is known, it still waits slotLendAfter.
func TestFastUplinkLendsWithinAChunksTime(t *testing.T) {
	t.Parallel()
	const fast, slow = 10e9 / 8, 100e6 / 8 // bytes/s
	const chunk = 16 << 20
	// Half a slot's share of 10 Gbit/s over 6 slots is about 104 MB/s: a
	// 16 MiB chunk's time at it 161 ms.
	at := func(sent int64, running time.Duration) Upload {
		return Upload{Sent: sent, Size: chunk, Running: running}
	}
	require.True(t, at(1<<20, 200*time.Millisecond).lends(fast, 6), "a quarter of the floor's pace, past the chunk's time")
	require.False(t, at(1<<20, 150*time.Millisecond).lends(fast, 6), "not yet a chunk's time at the floor")
	require.False(t, Upload{Sent: 1 << 20, Running: 200 * time.Millisecond}.lends(fast, 6), "size not known yet")
	require.False(t, at(1<<10, 500*time.Millisecond).lends(slow, 6), "a slow uplink waits slotLendAfter")
	require.True(t, at(1<<10, slotLendAfter).lends(slow, 6))
	require.False(t, Upload{Sent: 0, Size: 64 << 10, Running: 50 * time.Millisecond}.lends(fast, 6), "a tenth of a second at least")
}

func TestPaceMeterFollowsThePeak(t *testing.T) {
	t.Parallel()
	var m paceMeter
	at := time.Date(2026, 12, 6, 0, 0, 0, 0, time.UTC)
	require.Zero(t, m.observe(at, 0), "one look is no pace")
	require.Zero(t, m.observe(at.Add(time.Second), 5e6), "within a window, the pace so far")
	require.InDelta(t, 5e6, m.observe(at.Add(2*time.Second), 10e6), 1)
	require.InEpsilon(t, 5e6, m.observe(at.Add(4*time.Second), 12e6), 0.05, "a slower window keeps the peak")
	require.InEpsilon(t, 2.5e6, m.observe(at.Add(4*time.Second+paceHalfLife), 12e6), 0.05, "which halves over a half-life idle")
}

// On a fast link the meter need not wait out its window: once it has
// carried meterBytes, in meterMinWindow at least, that is its pace, so a
// server on 10 Gbit/s knows its uplink within the tenth of a second its
// first chunks take, not two seconds (a 1 GiB blob's whole fill there).
func TestPaceMeterOnAFastLink(t *testing.T) {
	t.Parallel()
	var m paceMeter
	at := time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC)
	require.Zero(t, m.observe(at, 0))
	require.Zero(t, m.observe(at.Add(50*time.Millisecond), 62e6), "too soon to tell")
	require.InEpsilon(t, 1.25e9, m.observe(at.Add(100*time.Millisecond), 125e6), 1e-9)
	require.Zero(t, (&paceMeter{at: at}).observe(at.Add(time.Second), 5e6), "a slow link still waits its window")
}

// A reader that takes its chunk slowly lends its upload slot once it has
// shown its pace: another request is served beside it.
func TestSlowReaderLendsItsSlot(t *testing.T) {
	t.Parallel()
	const size = 32 << 20 // more than the sockets' buffers hold
	data := randomBlob(11, size)
	store := newTestStore(t, cache.WithChunkSize(size))
	_, err := store.Fetch(context.Background(), descOf(data), memOrigin(data), nil)
	require.NoError(t, err)
	srv, ts := serveStore(t, store, WithMaxUploads(1), WithMaxUploadsPerPeer(2))
	srv.peersMu.Lock()
	srv.uplink = paceMeter{at: time.Now(), peak: 1 << 30} // as if it had sent at 1 GiB/s lately
	srv.peersMu.Unlock()
	url := ts.URL + fmt.Sprintf(chunkPath, descOf(data).Digest, 0)

	slowClient := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(slowClient.CloseIdleConnections)
	slow, err := slowClient.Get(url) // its body is not read until the end
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, slow.StatusCode)
	defer slow.Body.Close()

	require.Eventually(t, func() bool {
		resp, body := get(t, url)
		return resp.StatusCode == http.StatusOK && len(body) == size
	}, 10*time.Second, 100*time.Millisecond, "a second upload beside the slow one")
	require.GreaterOrEqual(t, testutil.ToFloat64(srv.m.lentSlots), 1.0)
	n, err := io.Copy(io.Discard, slow.Body)
	require.NoError(t, err)
	require.EqualValues(t, size, n, "the slow reader gets its chunk whole")
}
