package p2p

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

func randomBlob(seed uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)}).Read(b)
	return b
}

func descOf(b []byte) content.Descriptor {
	return content.Descriptor{Digest: digest.FromBytes(b), Size: int64(len(b))}
}

// memOrigin serves a blob from memory as a content.RangeOpener.
type memOrigin []byte

func (m memOrigin) OpenRange(_ context.Context, off int64) (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(m[off:])), nil
}

const testChunk = 64 << 10

func newTestStore(t *testing.T, opts ...cache.Option) *cache.Store {
	t.Helper()
	s, err := cache.Open(t.TempDir(), append([]cache.Option{cache.WithChunkSize(testChunk), cache.WithBudget(0, 0)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func get(t *testing.T, url string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, b
}

func TestChunkServerServesVerifiedChunks(t *testing.T) {
	t.Parallel()
	data := randomBlob(1, 3*testChunk+100)
	store := storeHolding(t, data)
	reg := prometheus.NewRegistry()
	srv, err := NewChunkServer(store, reg)
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	defer ts.Close()
	d := descOf(data).Digest

	resp, body := get(t, ts.URL+fmt.Sprintf(statePath, d))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	st, err := DecodePeerState(body)
	require.NoError(t, err)
	require.True(t, st.Complete)
	require.Equal(t, int64(len(data)), st.Size)
	for i := range 4 {
		sum := sha256.Sum256(data[i*testChunk : min((i+1)*testChunk, len(data))])
		require.Equal(t, sum[:], st.Hash(i))
		resp, body := get(t, ts.URL+fmt.Sprintf(chunkPath, d, i))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, data[i*testChunk:min((i+1)*testChunk, len(data))], body)
	}
	// A byte range inside a chunk.
	resp, body = get(t, ts.URL+fmt.Sprintf(chunkPath, d, 1), "Range", "bytes=10-19")
	require.Equal(t, http.StatusPartialContent, resp.StatusCode)
	require.Equal(t, data[testChunk+10:testChunk+20], body)
	require.Equal(t, fmt.Sprintf("bytes 10-19/%d", testChunk), resp.Header.Get("Content-Range"))
	resp, _ = get(t, ts.URL+fmt.Sprintf(chunkPath, d, 1), "Range", "bytes=999999-")
	require.Equal(t, http.StatusRequestedRangeNotSatisfiable, resp.StatusCode)
	require.Equal(t, float64(len(data)+10), testutil.ToFloat64(srv.m.servedBytes))

	for _, tc := range []struct {
		path string
		code int
	}{
		{fmt.Sprintf(chunkPath, d, 4), http.StatusNotFound},
		{fmt.Sprintf(chunkPath, digest.FromString("other"), 0), http.StatusNotFound},
		{fmt.Sprintf(statePath, digest.FromString("other")), http.StatusNotFound},
		{"/v1/blobs/sha256:zz/chunks/0", http.StatusBadRequest},
		{"/v1/blobs/" + d.String() + "/chunks/-1", http.StatusBadRequest},
		{"/v1/blobs/" + d.String() + "/chunks/01", http.StatusBadRequest},
		{"/v1/blobs/" + d.String() + "/chunks/x", http.StatusBadRequest},
		{"/v1/blobs/..%2f..%2fetc%2fpasswd/chunks/0", http.StatusBadRequest},
	} {
		resp, _ := get(t, ts.URL+tc.path)
		require.Equal(t, tc.code, resp.StatusCode, tc.path)
	}
}

func TestChunkServerServesOnlyVerifiedChunksOfDownloadInFlight(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	_, ts := serveStore(t, store)
	data := randomBlob(2, 3*testChunk)
	d := descOf(data).Digest
	checked := make(chan struct{})
	_, err := store.Fetch(context.Background(), descOf(data), fillFunc(func(ctx context.Context, p *cache.Partial) error {
		require.NoError(t, p.WriteChunk(2, data[2*testChunk:], nil))
		resp, body := get(t, ts.URL+fmt.Sprintf(statePath, d))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		st, err := DecodePeerState(body)
		require.NoError(t, err)
		require.False(t, st.Complete)
		require.Equal(t, []bool{false, false, true}, []bool{st.Has(0), st.Has(1), st.Has(2)})
		resp, _ = get(t, ts.URL+fmt.Sprintf(chunkPath, d, 0))
		require.Equal(t, http.StatusNotFound, resp.StatusCode)
		resp, body = get(t, ts.URL+fmt.Sprintf(chunkPath, d, 2))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, data[2*testChunk:], body)
		close(checked)
		require.NoError(t, p.WriteChunk(0, data[:testChunk], nil))
		return p.WriteChunk(1, data[testChunk:2*testChunk], nil)
	}), nil)
	require.NoError(t, err)
	<-checked
}

func TestChunkServerUploadSlots(t *testing.T) {
	t.Parallel()
	data := randomBlob(3, testChunk)
	store := storeHolding(t, data)
	srv, ts := serveStore(t, store, WithMaxUploads(1))
	up := mustTakeSlot(t, srv, "192.0.2.1") // one upload in progress
	resp, _ := get(t, ts.URL+fmt.Sprintf(chunkPath, descOf(data).Digest, 0))
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	srv.releaseSlot(up)
	resp, _ = get(t, ts.URL+fmt.Sprintf(chunkPath, descOf(data).Digest, 0))
	require.Equal(t, http.StatusOK, resp.StatusCode)
}

// One peer address holds at most its share of the upload slots, half of
// them rounded up; another peer still gets one.
func TestChunkServerUploadSlotsPerPeer(t *testing.T) {
	t.Parallel()
	data := randomBlob(5, testChunk)
	srv, ts := serveStore(t, storeHolding(t, data), WithMaxUploads(4))
	ours := mustTakeSlot(t, srv, "127.0.0.1")
	mustTakeSlot(t, srv, "127.0.0.1")
	url := ts.URL + fmt.Sprintf(chunkPath, descOf(data).Digest, 0)
	resp, body := get(t, url)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "the test's address holds its share")
	require.Equal(t, "server", resp.Header.Get(busyHeader))
	require.Contains(t, string(body), "its share of the upload slots")
	mustTakeSlot(t, srv, "192.0.2.1") // another peer gets a slot
	srv.releaseSlot(ours)
	resp, _ = get(t, url)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	// The handler gives its slot back after the client has the whole body.
	require.Eventually(t, func() bool { up, _ := srv.takeSlot("127.0.0.1", chunkKey{}); return up != nil }, 5*time.Second, time.Millisecond, "its share again")
	mustTakeSlot(t, srv, "192.0.2.2") // the last slot
	_, busy := srv.takeSlot("192.0.2.3", chunkKey{})
	require.Equal(t, "all upload slots busy", busy)
}

// mustTakeSlot takes an upload slot of srv for peer, as a request would,
// for an upload that sends fast: it never lends its slot (SlotsHeld).
func mustTakeSlot(t *testing.T, srv *ChunkServer, peer string) *upload {
	t.Helper()
	up, busy := srv.takeSlot(peer, chunkKey{})
	require.NotNil(t, up, busy)
	up.sent.Store(1 << 50)
	return up
}

// maxPeerStateBytes bounds every state of a blob of n chunks: every chunk
// present, every bitmap sent.
func TestMaxPeerStateBytes(t *testing.T) {
	t.Parallel()
	for _, n := range []int{1, 7, 8, 9, 1000} {
		all := make([]byte, (n+7)/8)
		for i := range n {
			all = setBit(all, i, true)
		}
		st := cache.ChunkState{Size: int64(n) * testChunk, ChunkSize: testChunk, Have: all, Hashes: make([]byte, n*32)}
		b := EncodePeerState(PeerState{ChunkState: st, Sent: all, Fetching: make([]byte, len(all)), Known: make([]byte, len(all))})
		require.Len(t, b, int(maxPeerStateBytes(n)), "%d chunks", n)
	}
	require.Equal(t, int64(maxChunkStateBytes), maxPeerStateBytes(maxChunkStateChunks+1), "never over any state's bound")
}

// storeHolding returns a test store that holds data whole.
func storeHolding(t *testing.T, data []byte) *cache.Store {
	t.Helper()
	store := newTestStore(t)
	_, err := store.Fetch(context.Background(), descOf(data), memOrigin(data), nil)
	require.NoError(t, err)
	return store
}

// serveStore runs a chunk server of store for the test.
func serveStore(t *testing.T, store ChunkStore, opts ...ServerOption) (*ChunkServer, *httptest.Server) {
	t.Helper()
	srv, err := NewChunkServer(store, nil, opts...)
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	return srv, ts
}

// fillFunc adapts a function to a cache source that fills chunk by chunk.
type fillFunc func(ctx context.Context, p *cache.Partial) error

func (f fillFunc) Fill(ctx context.Context, p *cache.Partial) error { return f(ctx, p) }

func (fillFunc) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, fmt.Errorf("not a stream")
}

func TestPeerStateRoundTrip(t *testing.T) {
	t.Parallel()
	st := cache.ChunkState{Size: 5*testChunk + 1, ChunkSize: testChunk, Have: []byte{0b101001}, Hashes: make([]byte, 6*32)}
	for _, i := range []int{0, 3, 5} {
		copy(st.Hashes[i*32:], bytes.Repeat([]byte{byte(i + 1)}, 32))
	}
	for _, p := range []PeerState{
		{ChunkState: st},
		{ChunkState: st, Origin: true},
		{ChunkState: st, Sent: []byte{0b100001}},
		{ChunkState: st, Origin: true, Sent: []byte{0b1}, Fetching: []byte{0b10010}},
	} {
		got, err := DecodePeerState(EncodePeerState(p))
		require.NoError(t, err)
		require.Equal(t, p, got)
	}

	// A state that leaves out the hashes the requester knows is shorter by
	// those, and the requester fills them in from its last state.
	full := PeerState{ChunkState: st}
	short := EncodePeerState(PeerState{ChunkState: st, Known: []byte{0b1001}})
	require.Len(t, short, len(EncodePeerState(full))+1-2*32, "one bitmap byte more, two hashes fewer")
	got, err := DecodePeerState(short)
	require.NoError(t, err)
	require.Equal(t, make([]byte, 32), got.Hash(0), "left out")
	require.NoError(t, got.fillKnown(full))
	require.Equal(t, full, got)
	got, err = DecodePeerState(short)
	require.NoError(t, err)
	require.Error(t, got.fillKnown(PeerState{ChunkState: cache.ChunkState{Size: st.Size, ChunkSize: st.ChunkSize, Have: []byte{0b1}, Hashes: st.Hashes}}),
		"a hash left out that the requester lacks")

	enc := func(p PeerState) []byte { return EncodePeerState(p) }
	for name, b := range map[string][]byte{
		"empty":           nil,
		"bad magic":       []byte("XXXX\x01\x00" + string(make([]byte, 16))),
		"trailing":        append(enc(PeerState{ChunkState: st}), 0),
		"short":           enc(PeerState{ChunkState: st})[:30],
		"bits past end":   enc(PeerState{ChunkState: cache.ChunkState{Size: 1, ChunkSize: testChunk, Have: []byte{0b10}, Hashes: make([]byte, 32)}}),
		"tiny chunks":     enc(PeerState{ChunkState: cache.ChunkState{Size: 10, ChunkSize: 1, Have: make([]byte, 2)}}),
		"complete holes":  enc(PeerState{ChunkState: cache.ChunkState{Size: 2 * testChunk, ChunkSize: testChunk, Complete: true, Have: []byte{1}, Hashes: make([]byte, 64)}}),
		"sent, not held":  enc(PeerState{ChunkState: st, Sent: []byte{0b10}}),
		"fetching, held":  enc(PeerState{ChunkState: st, Fetching: []byte{0b1000}}),
		"known, not held": enc(PeerState{ChunkState: st, Known: []byte{0b10}}),
	} {
		_, err := DecodePeerState(b)
		require.Error(t, err, name)
	}
}

func TestChunkServerTellsSentChunksAndWaitsForNews(t *testing.T) {
	t.Parallel()
	store := newTestStore(t)
	_, ts := serveStore(t, store)
	data := randomBlob(4, 3*testChunk)
	d := descOf(data).Digest
	_, err := store.Fetch(context.Background(), descOf(data), fillFunc(func(ctx context.Context, p *cache.Partial) error {
		require.NoError(t, p.WriteChunk(0, data[:testChunk], nil))
		get(t, ts.URL+fmt.Sprintf(chunkPath, d, 0))
		resp, body := get(t, ts.URL+fmt.Sprintf(statePath, d))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		st, err := DecodePeerState(body)
		require.NoError(t, err)
		require.True(t, st.WasSent(0))
		require.False(t, st.WasSent(1))

		// A state request that already knows one chunk waits for the next.
		answered := waitForNews(t, ts.URL+fmt.Sprintf(statePath, d)+"?since=1&wait=2s")
		require.NoError(t, p.WriteChunk(2, data[2*testChunk:], nil))
		st = <-answered
		require.True(t, st.Has(2), "answered with the news")
		return p.WriteChunk(1, data[testChunk:2*testChunk], nil)
	}), nil)
	require.NoError(t, err)
	resp, _ := get(t, ts.URL+fmt.Sprintf(statePath, d)+"?since=x")
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)

	// A requester that knows the hash of chunk 1 does not get it again.
	_, body := get(t, ts.URL+fmt.Sprintf(statePath, d)+"?known="+base64.RawURLEncoding.EncodeToString([]byte{0b10}))
	st, err := DecodePeerState(body)
	require.NoError(t, err)
	require.True(t, st.Complete)
	require.Equal(t, []byte{0b10}, st.Known)
	require.Equal(t, make([]byte, 32), st.Hash(1))
	require.NotEqual(t, make([]byte, 32), st.Hash(2))
	resp, _ = get(t, ts.URL+fmt.Sprintf(statePath, d)+"?known=AAAA")
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "a bitmap of the wrong length")
}

// waitForNews asks for a chunk state that waits for news, checks that no
// answer comes for 200 ms, and returns the channel the answer comes on.
func waitForNews(t *testing.T, url string) <-chan PeerState {
	answered := make(chan PeerState)
	go func() {
		_, body := get(t, url)
		st, _ := DecodePeerState(body)
		answered <- st
	}()
	select {
	case <-answered:
		t.Fatal("answered without news")
	case <-time.After(200 * time.Millisecond):
	}
	return answered
}

// originSwarm is a swarm downloader that fetches d from the origin.
func originSwarm(t *testing.T, d digest.Digest) *Swarm {
	// The tests ask from loopback, where their member listens.
	dir := staticDir{local: "fetcher", peers: map[string]Peer{"a": {Name: "a", Meta: NodeMeta{ChunkAddr: "127.0.0.1:4000"}}}}
	sw, err := NewSwarm(dir, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	sw.setOrigin(d, true, 0)
	return sw
}

// A state tells those who ask the chunks on their way to the server (less
// those it holds), and a watcher hears of each new one.
func TestChunkServerTellsChunksOnTheirWay(t *testing.T) {
	t.Parallel()
	data := randomBlob(41, 3*testChunk)
	d := descOf(data).Digest
	sw := originSwarm(t, d)
	store := newTestStore(t)
	_, ts := serveStore(t, store, WithSwarm(sw))
	for i := range 2 {
		c := sw.live.chunk(d, i, testChunk)
		c.share()
		t.Cleanup(func() { c.settle(nil) })
	}
	_, err := store.Fetch(context.Background(), descOf(data), fillFunc(func(ctx context.Context, p *cache.Partial) error {
		require.NoError(t, p.WriteChunk(0, data[:testChunk], nil))
		_, body := get(t, ts.URL+fmt.Sprintf(statePath, d))
		st, err := DecodePeerState(body)
		require.NoError(t, err)
		require.Nil(t, st.Fetching, "not asked for: agents that predate it reject the bitmap")
		_, body = get(t, ts.URL+fmt.Sprintf(statePath, d)+"?fetching=0")
		st, err = DecodePeerState(body)
		require.NoError(t, err)
		require.Equal(t, []bool{false, true, false}, []bool{st.IsFetching(0), st.IsFetching(1), st.IsFetching(2)},
			"chunk 0 is held, not fetched")

		answered := waitForNews(t, ts.URL+fmt.Sprintf(statePath, d)+"?since=1&wait=2s&origin=1&sent=0&fetching=1")
		c := sw.live.chunk(d, 2, testChunk)
		c.share()
		defer c.settle(nil)
		st = <-answered
		require.True(t, st.IsFetching(1) && st.IsFetching(2), "answered with the new request")
		require.NoError(t, p.WriteChunk(1, data[testChunk:2*testChunk], nil))
		return p.WriteChunk(2, data[2*testChunk:], nil)
	}), nil)
	require.NoError(t, err)
	resp, _ := get(t, ts.URL+fmt.Sprintf(statePath, d)+"?fetching=-1")
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
}

func FuzzDecodePeerState(f *testing.F) {
	f.Add(EncodePeerState(PeerState{ChunkState: cache.ChunkState{Size: 3 * testChunk, ChunkSize: testChunk, Have: []byte{0b101}, Hashes: make([]byte, 96)}, Sent: []byte{1}}))
	f.Add(EncodePeerState(PeerState{ChunkState: cache.ChunkState{Size: testChunk, ChunkSize: testChunk, Complete: true, Have: []byte{1}, Hashes: make([]byte, 32)}}))
	f.Add(EncodePeerState(PeerState{ChunkState: cache.ChunkState{Size: testChunk, ChunkSize: testChunk, Have: []byte{0}}, Origin: true}))
	f.Add(EncodePeerState(PeerState{ChunkState: cache.ChunkState{Size: 3 * testChunk, ChunkSize: testChunk, Have: []byte{0b1}, Hashes: make([]byte, 32)}, Origin: true, Fetching: []byte{0b110}}))
	f.Add(EncodePeerState(PeerState{ChunkState: cache.ChunkState{Size: 3 * testChunk, ChunkSize: testChunk, Have: []byte{0b101}, Hashes: make([]byte, 96)}, Known: []byte{0b100}}))
	f.Add([]byte("WDCS\x01\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := DecodePeerState(b)
		if err != nil {
			return
		}
		n := chunksOf(st.Size, st.ChunkSize)
		if len(st.Hashes) != n*32 || len(st.Have) != (n+7)/8 {
			t.Fatalf("inconsistent state: %d chunks, %d hash bytes, %d bitmap bytes", n, len(st.Hashes), len(st.Have))
		}
		if !bytes.Equal(EncodePeerState(st), b) {
			t.Fatal("accepted a non-canonical encoding")
		}
	})
}

func TestUploadLimitPacesChunks(t *testing.T) {
	t.Parallel()
	data := randomBlob(5, 8*testChunk)
	store := storeHolding(t, data)
	srv, ts := serveStore(t, store, WithUploadLimit(64<<10)) // the burst covers the sends; refilling it takes 8 s
	require.NotNil(t, srv.upload)
	full := srv.upload.Tokens()
	for i := range 8 {
		resp, body := get(t, ts.URL+fmt.Sprintf(chunkPath, descOf(data).Digest, i))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Len(t, body, testChunk)
	}
	// Every byte sent took a token: the bucket is down by about what was
	// sent beyond what refilled meanwhile (no timing assumed).
	require.Less(t, srv.upload.Tokens(), full, "the upload limiter paced the chunks")
	srvNone, _ := serveStore(t, store)
	require.Nil(t, srvNone.upload, "no limit by default")
}

// A busy peer answers 503 often; each answer must leave its connection in
// the pool, or every retry opens a connection (and a fresh TCP slow start).
func TestBusyAnswerKeepsTheConnection(t *testing.T) {
	t.Parallel()
	data := randomBlob(4, testChunk)
	store := storeHolding(t, data)
	srv, err := NewChunkServer(store, nil, WithMaxUploads(1))
	require.NoError(t, err)
	var opened atomic.Int64
	ts := httptest.NewUnstartedServer(srv.Handler())
	ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			opened.Add(1)
		}
	}
	ts.Start()
	t.Cleanup(ts.Close)
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	addr := strings.TrimPrefix(ts.URL, "http://")
	d := descOf(data).Digest
	fetch := func() error {
		_, err := s.fetchChunk(context.Background(), addr, d, 0, time.Minute, false, false, newLiveChunk(testChunk))
		return err
	}
	up := mustTakeSlot(t, srv, "192.0.2.1") // every upload slot taken
	for range 5 {
		require.ErrorIs(t, fetch(), errBusy)
	}
	srv.releaseSlot(up)
	claim, err := s.fetchChunk(context.Background(), addr, d, 0, time.Minute, false, false, newLiveChunk(testChunk))
	require.NoError(t, err)
	sum := sha256.Sum256(data)
	require.Equal(t, sum[:], claim, "a whole chunk comes with its hash")
	require.Equal(t, int64(1), opened.Load(), "five busy answers and a chunk over one connection")
}

// An origin fetcher sends each chunk once (its upload is the swarm's
// narrowest pipe), and tells watchers of each first send at once; a node
// without the role sends a chunk as often as it is asked.
func TestOriginFetcherSendsEachChunkOnce(t *testing.T) {
	t.Parallel()
	data := randomBlob(6, 3*testChunk)
	d := descOf(data).Digest
	store := newTestStore(t)
	_, origin := serveStore(t, store, WithSwarm(originSwarm(t, d)))
	_, plain := serveStore(t, store)
	status := func(url string, i int) int {
		resp, err := http.Get(url + fmt.Sprintf(chunkPath, d, i))
		if err != nil {
			return 0
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get(busyHeader) != "chunk" {
			return -1
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode
	}
	var watched PeerState
	var sends []int
	// The checks run while the blob is partial; the fill runs on a
	// goroutine of the store's, so it records what it saw and returns.
	_, err := store.Fetch(context.Background(), descOf(data), fillFunc(func(ctx context.Context, p *cache.Partial) error {
		if err := p.WriteChunk(0, data[:testChunk], nil); err != nil {
			return err
		}
		if err := p.WriteChunk(1, data[testChunk:2*testChunk], nil); err != nil {
			return err
		}
		news := make(chan PeerState, 1)
		go func() {
			var st PeerState
			if resp, err := http.Get(origin.URL + fmt.Sprintf(statePath, d) + "?since=2&origin=1&sent=0&wait=2s"); err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				st, _ = DecodePeerState(b)
			}
			news <- st
		}()
		select {
		case <-news:
			return errors.New("answered without news")
		case <-time.After(200 * time.Millisecond):
		}
		sends = append(sends, status(origin.URL, 1))
		select {
		case watched = <-news:
		case <-time.After(time.Second): // a second before its wait ends
			return errors.New("the send was not news")
		}
		sends = append(sends, status(origin.URL, 1), status(origin.URL, 0), status(plain.URL, 1), status(plain.URL, 1))
		return p.WriteChunk(2, data[2*testChunk:], nil)
	}), nil)
	require.NoError(t, err)
	require.True(t, watched.WasSent(1), "the watcher learned of the send")
	require.Equal(t, []int{200, 503, 200, 200, 200}, sends,
		"chunk 1 sent; not again by the origin fetcher; chunk 0 sent; chunk 1 twice by a node without the role")
	resp, _ := get(t, origin.URL+fmt.Sprintf(statePath, d)+"?sent=x")
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
}

// An origin fetcher with upload slots sends a chunk again while half its
// slots are free, one such repeat at a time; first copies go out anyway.
func TestOriginFetcherRepeatsWhenItsUploadHasRoom(t *testing.T) {
	t.Parallel()
	data := randomBlob(7, 2*testChunk)
	d := descOf(data).Digest
	srv, ts := serveStore(t, storeHolding(t, data), WithSwarm(originSwarm(t, d)), WithMaxUploads(4))
	// A handler gives back its slot and its repeat just after the client
	// has the answer: each request starts once the last one's are back.
	var held []*upload // slots the test holds
	status := func(i int) int {
		require.Eventually(t, func() bool { return srv.slotsHeld() == len(held) }, 5*time.Second, time.Millisecond)
		resp, _ := get(t, ts.URL+fmt.Sprintf(chunkPath, d, i))
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, status(0), "first copy")
	require.Equal(t, http.StatusOK, status(0), "a repeat: the upload is idle")

	require.Eventually(t, func() bool { return srv.repeating.CompareAndSwap(false, true) }, 5*time.Second, time.Millisecond) // another repeat is being sent
	require.Equal(t, http.StatusServiceUnavailable, status(0), "one repeat at a time")
	srv.repeating.Store(false)

	// Two uploads in progress: with this one, three of four slots.
	held = []*upload{mustTakeSlot(t, srv, "192.0.2.1"), mustTakeSlot(t, srv, "192.0.2.2")}
	require.Equal(t, http.StatusServiceUnavailable, status(0), "first copies keep the busy upload")
	require.Equal(t, http.StatusOK, status(1), "a first copy goes out")
	srv.releaseSlot(held[1])
	held = held[:1]
	require.Equal(t, http.StatusOK, status(0), "with half the slots free again, a repeat")
}

// A chunk on its way is relayed as it comes: each piece once it has come,
// the last once the chunk is verified, then the chunk's hash; a chunk that
// fails here ends its relay short, without a hash.
func TestChunkServerRelaysChunksOnTheirWay(t *testing.T) {
	t.Parallel()
	data := randomBlob(43, 3*sendPiece)
	d := descOf(data).Digest
	sum := sha256.Sum256(data)
	sw, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	srv, ts := serveStore(t, newTestStore(t), WithSwarm(sw))
	for _, verified := range []bool{true, false} {
		c := sw.live.chunk(d, 0, int64(len(data)))
		resp, _ := get(t, ts.URL+fmt.Sprintf(chunkPath, d, 0))
		require.Equal(t, http.StatusNotFound, resp.StatusCode, "not on its way until its source answers")
		c.share()
		copy(c.data(), data[:sendPiece])
		c.progress(sendPiece)
		resp, err := http.Get(ts.URL + fmt.Sprintf(chunkPath, d, 0))
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.NotEmpty(t, resp.Header.Get(relayHeader))
		first := make([]byte, sendPiece)
		_, err = io.ReadFull(resp.Body, first)
		require.NoError(t, err)
		require.Equal(t, data[:sendPiece], first, "the first piece, before the rest came")

		copy(c.data()[sendPiece:], data[sendPiece:])
		c.progress(int64(len(data)))
		rest := make(chan []byte)
		go func() {
			b, _ := io.ReadAll(resp.Body)
			rest <- b
		}()
		select {
		case <-rest:
			t.Fatal("the last piece went before the chunk was verified")
		case <-time.After(200 * time.Millisecond):
		}
		if verified {
			c.settle(sum[:])
			require.Equal(t, data[sendPiece:], <-rest)
			require.Equal(t, hex.EncodeToString(sum[:]), resp.Trailer.Get(hashHeader))
		} else {
			c.settle(nil)
			require.Equal(t, data[sendPiece:len(data)-relayPiece], <-rest, "cut before the last piece")
			require.Empty(t, resp.Trailer.Get(hashHeader))
		}
		resp.Body.Close()
		resp, _ = get(t, ts.URL+fmt.Sprintf(chunkPath, d, 0))
		require.Equal(t, http.StatusNotFound, resp.StatusCode, "no longer on its way; not in the store")
	}
	require.Equal(t, 2.0, testutil.ToFloat64(srv.m.requests.WithLabelValues("relay", "200")))

	// The swarm's side: the relay's hash when the chunk was verified, a
	// cut (not the relay's fault) when it failed.
	relays := 2.0
	for _, verified := range []bool{true, false} {
		c := sw.live.chunk(d, 0, int64(len(data)))
		c.share()
		relays++
		type result struct {
			claim []byte
			err   error
		}
		done := make(chan result)
		go func() {
			claim, err := sw.fetchChunk(context.Background(), strings.TrimPrefix(ts.URL, "http://"), d, 0, time.Minute, false, false, newLiveChunk(int64(len(data))))
			done <- result{claim, err}
		}()
		require.Eventually(t, func() bool { return testutil.ToFloat64(srv.m.requests.WithLabelValues("relay", "200")) == relays },
			5*time.Second, time.Millisecond, "relaying")
		copy(c.data(), data)
		c.progress(int64(len(data)))
		if verified {
			c.settle(sum[:])
			r := <-done
			require.NoError(t, r.err)
			require.Equal(t, sum[:], r.claim)
		} else {
			c.settle(nil)
			require.ErrorIs(t, (<-done).err, errRelayCut)
		}
	}
}

// A holder of the whole blob is the only source of the chunks no one else
// has yet: while it sends a chunk to a member at a fair pace, and its
// upload is busy, it refuses that chunk to the others, who get it from
// the receiver as it comes. A slow reader's send, once its slot is lent,
// does not keep the chunk from anyone, nor does a send to a client that
// is no member, which would not relay it.
func TestWholeHolderSendsAChunkOnceWhileItMoves(t *testing.T) {
	t.Parallel()
	const size = 32 << 20 // more than the sockets' buffers hold
	data := randomBlob(12, 2*size)
	store := newTestStore(t, cache.WithChunkSize(size))
	_, err := store.Fetch(context.Background(), descOf(data), memOrigin(data), nil)
	require.NoError(t, err)
	url := func(ts *httptest.Server, i int) string {
		return ts.URL + fmt.Sprintf(chunkPath, descOf(data).Digest, i)
	}
	for _, member := range []bool{true, false} {
		dir := staticDir{local: "holder", peers: map[string]Peer{}}
		if member {
			dir.peers["reader"] = Peer{Name: "reader", Meta: NodeMeta{ChunkAddr: "127.0.0.1:7947"}}
		}
		sw, err := NewSwarm(dir, nil, SwarmConfig{}, nil, nil)
		require.NoError(t, err)
		srv, ts := serveStore(t, store, WithSwarm(sw), WithMaxUploads(2), WithMaxUploadsPerPeer(3))
		srv.peersMu.Lock()
		srv.uplink = paceMeter{at: time.Now(), peak: 1 << 30} // as if it had sent at 1 GiB/s lately
		srv.peersMu.Unlock()

		firstClient := &http.Client{Transport: &http.Transport{}}
		t.Cleanup(firstClient.CloseIdleConnections)
		first, err := firstClient.Get(url(ts, 0)) // read only at the end: a slow reader, once a second has gone
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, first.StatusCode)

		again, body := get(t, url(ts, 0))
		if !member {
			require.Equal(t, http.StatusOK, again.StatusCode, "a send to a client that is no member keeps the chunk from no one")
			require.Len(t, body, size)
			first.Body.Close()
			continue
		}
		require.Equal(t, http.StatusServiceUnavailable, again.StatusCode, "chunk 0 is on its way to a member")
		require.Equal(t, "chunk", again.Header.Get(busyHeader))
		other, body := get(t, url(ts, 1))
		require.Equal(t, http.StatusOK, other.StatusCode, "another chunk goes out")
		require.Len(t, body, size)

		require.Eventually(t, func() bool {
			resp, body := get(t, url(ts, 0))
			return resp.StatusCode == http.StatusOK && len(body) == size
		}, 10*time.Second, 100*time.Millisecond, "the first reader's send lent its slot: chunk 0 goes out again")
		n, err := io.Copy(io.Discard, first.Body)
		require.NoError(t, err)
		require.EqualValues(t, size, n)
		first.Body.Close()
	}
}
