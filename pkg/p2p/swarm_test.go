package p2p

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/cache"
)

// countingOrigin serves a blob from memory and counts the bytes it sends.
type countingOrigin struct {
	data []byte
	sent atomic.Int64
	down atomic.Bool // refuses every request when set
}

func (o *countingOrigin) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	return o.OpenBoundedRange(ctx, off, int64(len(o.data))-off)
}

func (o *countingOrigin) OpenBoundedRange(_ context.Context, off, n int64) (io.ReadCloser, error) {
	if o.down.Load() {
		return nil, errors.New("origin unreachable")
	}
	return io.NopCloser(&countingReader{r: bytes.NewReader(o.data[off : off+n]), n: &o.sent}), nil
}

type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// swarmNode is one in-process agent: store, membership, chunk server, swarm.
type swarmNode struct {
	name   string
	store  *cache.Store
	m      *Membership
	swarm  *Swarm
	server *ChunkServer
	res    *Resolutions
	stop   context.CancelFunc
	done   chan struct{}
}

type swarmNodeOpts struct {
	wrap   func(http.Handler) http.Handler // around the chunk server
	upload int64
}

func startSwarmNode(t *testing.T, name string, seeds []string, o swarmNodeOpts) *swarmNode {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	router := NewRouter(time.Minute)
	m, err := NewMembership(MembershipConfig{
		NodeName: name, BindAddr: "127.0.0.1", Join: seeds, Fast: true,
		Meta: NodeMeta{ChunkAddr: ln.Addr().String()},
	}, router)
	require.NoError(t, err)
	store, err := cache.Open(t.TempDir(), cache.WithChunkSize(testChunk), cache.WithBudget(0, 0),
		cache.WithEvents(Announcer(m, slog.New(slog.DiscardHandler))))
	require.NoError(t, err)
	swarm, err := NewSwarm(NewDirectory(m, router), nil, SwarmConfig{Settle: 300 * time.Millisecond, Refresh: 50 * time.Millisecond, BanFor: time.Minute}, nil, prometheus.NewRegistry())
	require.NoError(t, err)
	res := NewResolutions(2)
	server, err := NewChunkServer(store, nil, WithSwarm(swarm), WithUploadLimit(o.upload), WithResolutions(res))
	require.NoError(t, err)
	handler := server.Handler()
	if o.wrap != nil {
		handler = o.wrap(handler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	n := &swarmNode{name: name, store: store, m: m, swarm: swarm, server: server, res: res, stop: cancel, done: make(chan struct{})}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return m.Run(gctx) })
	srv := &http.Server{Handler: handler}
	g.Go(func() error {
		go func() { <-gctx.Done(); srv.Close() }()
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	go func() {
		g.Wait()
		close(n.done)
	}()
	t.Cleanup(func() { n.kill(); store.Close() })
	<-m.Ready()
	return n
}

func (n *swarmNode) kill() {
	n.stop()
	<-n.done
}

// startSwarmCluster starts n nodes joined through the first and waits until
// every node sees every other.
func startSwarmCluster(t *testing.T, n int, opts map[int]swarmNodeOpts) []*swarmNode {
	t.Helper()
	nodes := []*swarmNode{startSwarmNode(t, "n0", nil, opts[0])}
	for i := 1; i < n; i++ {
		nodes = append(nodes, startSwarmNode(t, fmt.Sprintf("n%d", i), []string{nodes[0].m.LocalAddr()}, opts[i]))
	}
	require.Eventually(t, func() bool {
		for _, nd := range nodes {
			if len(nd.m.Members()) != n-1 {
				return false
			}
		}
		return true
	}, 10*time.Second, 10*time.Millisecond)
	return nodes
}

func (n *swarmNode) fetch(ctx context.Context, data []byte, origin cache.RangeOpener) error {
	desc := descOf(data)
	if _, err := n.store.Fetch(ctx, desc, n.swarm.Source(desc, origin), nil); err != nil {
		return fmt.Errorf("%s: %w", n.name, err)
	}
	f, err := n.store.Open(desc.Digest)
	if err != nil {
		return err
	}
	defer f.Close()
	got, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, data) {
		return fmt.Errorf("%s: wrong bytes", n.name)
	}
	return nil
}

// fetchAll has every node fetch data at once, each from originOf(node),
// within timeout.
func fetchAll(nodes []*swarmNode, data []byte, timeout time.Duration, originOf func(*swarmNode) cache.RangeOpener) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	for _, n := range nodes {
		g.Go(func() error { return n.fetch(ctx, data, originOf(n)) })
	}
	return g.Wait()
}

func TestSwarmOriginServesAboutOneCopy(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 4, nil)
	data := randomBlob(10, 40*testChunk)
	origin := &countingOrigin{data: data}
	require.NoError(t, fetchAll(nodes, data, 30*time.Second, func(*swarmNode) cache.RangeOpener { return origin }))
	ratio := float64(origin.sent.Load()) / float64(len(data))
	t.Logf("origin served %.2f copies to %d nodes", ratio, len(nodes))
	for _, n := range nodes {
		t.Logf("%s: origin role %v, from origin %v, from peers %v", n.name, testutil.ToFloat64(n.swarm.m.originRole),
			testutil.ToFloat64(n.swarm.m.received.WithLabelValues("origin")), testutil.ToFloat64(n.swarm.m.received.WithLabelValues("peer")))
	}
	require.LessOrEqual(t, ratio, 1.05, "the origin serves about one copy, not one per node")
	var fromPeers float64
	for _, n := range nodes {
		peer := testutil.ToFloat64(n.swarm.m.received.WithLabelValues("peer"))
		fromOrigin := testutil.ToFloat64(n.swarm.m.received.WithLabelValues("origin"))
		require.Equal(t, float64(len(data)), peer+fromOrigin, "%s counts every byte once", n.name)
		fromPeers += peer
	}
	require.GreaterOrEqual(t, fromPeers, float64(2*len(data)), "the other nodes got their bytes from peers")
}

// slowOrigin is an origin whose every range takes delay to open.
type slowOrigin struct {
	*countingOrigin
	delay time.Duration
}

func (o slowOrigin) OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error) {
	select {
	case <-time.After(o.delay):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return o.countingOrigin.OpenBoundedRange(ctx, off, n)
}

// lateOrigin answers at once but sends each range's bytes only after
// delay: its chunks are on their way to the fetchers that long.
type lateOrigin struct {
	*countingOrigin
	delay time.Duration
}

func (o lateOrigin) OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error) {
	body, err := o.countingOrigin.OpenBoundedRange(ctx, off, n)
	if err != nil {
		return nil, err
	}
	late := readerFunc(func([]byte) (int, error) {
		select {
		case <-time.After(o.delay):
			return 0, io.EOF
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	})
	return struct {
		io.Reader
		io.Closer
	}{io.MultiReader(late, body), body}, nil
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }

// The nodes ask for chunks still on their way to a peer, which relays
// them; the blob is whole everywhere and the origin sends one copy.
func TestSwarmRelaysChunksOnTheirWay(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 4, nil)
	data := randomBlob(44, 24*testChunk)
	origin := &countingOrigin{data: data}
	require.NoError(t, fetchAll(nodes, data, 30*time.Second, func(*swarmNode) cache.RangeOpener {
		return lateOrigin{origin, 300 * time.Millisecond}
	}))
	relayed := 0.0
	for _, n := range nodes {
		relayed += testutil.ToFloat64(n.server.m.requests.WithLabelValues("relay", "200"))
	}
	t.Logf("%.0f chunks relayed; origin served %.2f copies", relayed, float64(origin.sent.Load())/float64(len(data)))
	require.Positive(t, relayed)
	require.LessOrEqual(t, float64(origin.sent.Load())/float64(len(data)), 1.05, "the origin serves about one copy")
}

// An origin fetcher that is done with its share takes over part of a slower
// fetcher's, and the origin still sends one copy.
func TestOriginFetcherHelpsASlowerOne(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 4, nil)
	data := randomBlob(12, 40*testChunk)
	var names []string
	for _, n := range nodes {
		names = append(names, n.name)
	}
	fetchers := rendezvous(descOf(data).Digest, names)[:2] // in share order
	origin := &countingOrigin{data: data}
	require.NoError(t, fetchAll(nodes, data, 30*time.Second, func(n *swarmNode) cache.RangeOpener {
		if n.name == fetchers[0] {
			return slowOrigin{origin, 600 * time.Millisecond}
		}
		return slowOrigin{origin, 150 * time.Millisecond}
	}))
	fromOrigin := map[string]float64{}
	for _, n := range nodes {
		fromOrigin[n.name] = testutil.ToFloat64(n.swarm.m.received.WithLabelValues("origin"))
	}
	t.Logf("origin served %.2f copies; by node: %v", float64(origin.sent.Load())/float64(len(data)), fromOrigin)
	require.LessOrEqual(t, float64(origin.sent.Load())/float64(len(data)), 1.05, "the origin serves about one copy")
	require.Greater(t, fromOrigin[fetchers[1]], float64(len(data))/2, "the faster fetcher took part of the slower one's share")
}

func TestSwarmCompletesFromPeersWhenOriginIsGone(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 3, nil)
	data := randomBlob(11, 20*testChunk)
	origin := &countingOrigin{data: data}
	require.NoError(t, nodes[0].fetch(context.Background(), data, origin))
	origin.down.Store(true) // one copy exists in the cluster; the origin goes away
	require.Eventually(t, func() bool {
		hs := nodes[1].swarm.dir.Holders(descOf(data).Digest)
		return len(hs) == 1 && hs[0].Complete
	}, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, fetchAll(nodes[1:], data, 20*time.Second, func(*swarmNode) cache.RangeOpener { return origin }))
}

// TestProgressCountsBytesFromPeers: a fetch's progress says how much came
// from peers (the CSI plugin's "61% from peers"): none for the node that
// asked the origin, all for the one that asked its peer.
func TestProgressCountsBytesFromPeers(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 2, nil)
	data := randomBlob(12, 8*testChunk)
	desc := descOf(data)
	origin := &countingOrigin{data: data}
	for i, want := range []int64{0, int64(len(data))} {
		if i == 1 {
			origin.down.Store(true)
			require.Eventually(t, func() bool {
				hs := nodes[1].swarm.dir.Holders(desc.Digest)
				return len(hs) == 1 && hs[0].Complete
			}, 5*time.Second, 10*time.Millisecond)
		}
		var peers atomic.Int64
		_, err := nodes[i].store.Fetch(context.Background(), desc, nodes[i].swarm.Source(desc, origin), func(_, fromPeers, _ int64) { peers.Store(fromPeers) })
		require.NoError(t, err)
		require.Equal(t, want, peers.Load(), "node %d's bytes from peers", i)
	}
}

// corruptChunks flips a byte in every chunk body the wrapped server sends.
func corruptChunks(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &bufferedResponse{header: http.Header{}}
		next.ServeHTTP(rec, r)
		body := rec.body.Bytes()
		if strings.Contains(r.URL.Path, "/chunks/") && rec.code == http.StatusOK {
			body[0] ^= 0xff
		}
		for k, v := range rec.header {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.code)
		w.Write(body)
	})
}

// bufferedResponse records a handler's response so a test can alter it.
type bufferedResponse struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (b *bufferedResponse) Header() http.Header { return b.header }
func (b *bufferedResponse) WriteHeader(code int) {
	if b.code == 0 {
		b.code = code
	}
}
func (b *bufferedResponse) Write(p []byte) (int, error) {
	if b.code == 0 {
		b.code = http.StatusOK
	}
	return b.body.Write(p)
}

func TestSwarmBansPeerServingCorruptChunks(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 2, map[int]swarmNodeOpts{0: {wrap: corruptChunks}})
	data := randomBlob(12, 10*testChunk)
	origin := &countingOrigin{data: data}
	require.NoError(t, nodes[0].fetch(context.Background(), data, origin))
	require.Eventually(t, func() bool { return len(nodes[1].swarm.dir.Holders(descOf(data).Digest)) == 1 }, 5*time.Second, 10*time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, nodes[1].fetch(ctx, data, origin))
	require.True(t, nodes[1].swarm.Banned("n0"), "the peer that served corrupt chunks is banned")
	require.Equal(t, 1.0, testutil.ToFloat64(nodes[1].swarm.m.bans.WithLabelValues("corrupt_chunk")))
}

func TestSwarmRepairsWrongChunkMap(t *testing.T) {
	// A peer whose chunk map matches its corrupt chunks passes every chunk
	// check; only the whole-blob sha256 catches it.
	data := randomBlob(13, 6*testChunk)
	lie := func(st cache.ChunkState) cache.ChunkState {
		st.Hashes = bytes.Clone(st.Hashes)
		for i := range chunksOf(st.Size, st.ChunkSize) {
			c := bytes.Clone(data[i*testChunk : min((i+1)*testChunk, len(data))])
			c[0] ^= 0xff
			sum := sha256.Sum256(c)
			copy(st.Hashes[i*32:], sum[:])
		}
		return st
	}
	wrap := func(next http.Handler) http.Handler {
		corrupt := corruptChunks(next)
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !strings.HasSuffix(r.URL.Path, "/state") {
				corrupt.ServeHTTP(w, r)
				return
			}
			rec := &bufferedResponse{header: http.Header{}}
			next.ServeHTTP(rec, r)
			st, err := DecodePeerState(rec.body.Bytes())
			if err != nil {
				http.Error(w, err.Error(), rec.code)
				return
			}
			st.ChunkState = lie(st.ChunkState)
			w.Write(EncodePeerState(st))
		})
	}
	nodes := startSwarmCluster(t, 2, map[int]swarmNodeOpts{0: {wrap: wrap}})
	origin := &countingOrigin{data: data}
	require.NoError(t, nodes[0].fetch(context.Background(), data, origin))
	require.Eventually(t, func() bool { return len(nodes[1].swarm.dir.Holders(descOf(data).Digest)) == 1 }, 5*time.Second, 10*time.Millisecond)
	sentBefore := origin.sent.Load()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, nodes[1].fetch(ctx, data, origin))
	require.True(t, nodes[1].swarm.Banned("n0"))
	require.Equal(t, 1.0, testutil.ToFloat64(nodes[1].swarm.m.bans.WithLabelValues("wrong_chunk_map")))
	require.Equal(t, int64(len(data)), origin.sent.Load()-sentBefore, "the bad chunks were fetched again from the origin")
}

func TestSwarmSurvivesPeerKilledMidTransfer(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 3, map[int]swarmNodeOpts{0: {upload: 2 << 20}})
	data := randomBlob(14, 48*testChunk)
	origin := &countingOrigin{data: data}
	require.NoError(t, nodes[0].fetch(context.Background(), data, origin))
	require.Eventually(t, func() bool { return len(nodes[1].swarm.dir.Holders(descOf(data).Digest)) == 1 }, 5*time.Second, 10*time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	g, gctx := errgroup.WithContext(ctx)
	for _, n := range nodes[1:] {
		g.Go(func() error { return n.fetch(gctx, data, origin) })
	}
	// Kill the only complete holder once the others are under way (it
	// uploads at 2 MiB/s, so 3 MiB of blob takes seconds).
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(nodes[0].server.m.servedBytes) > 256<<10
	}, 10*time.Second, 5*time.Millisecond)
	nodes[0].kill()
	require.NoError(t, g.Wait())
}

func TestRendezvousIsStable(t *testing.T) {
	t.Parallel()
	d := digest.FromString("blob")
	names := []string{"a", "b", "c", "d", "e"}
	order := rendezvous(d, names)
	require.ElementsMatch(t, names, order)
	require.Equal(t, order, rendezvous(d, []string{"e", "d", "c", "b", "a"}), "independent of input order")
	without := rendezvous(d, append(append([]string{}, order[:2]...), order[3:]...))
	require.Equal(t, append(append([]string{}, order[:2]...), order[3:]...), without, "removing one keeps the rest in order")
	other := rendezvous(digest.FromString("another"), names)
	firsts := map[string]bool{order[0]: true, other[0]: true}
	for i := range 20 {
		firsts[rendezvous(digest.FromString(fmt.Sprint(i)), names)[0]] = true
	}
	require.Greater(t, len(firsts), 2, "different blobs pick different origin fetchers")
}

func TestResolveFromPeers(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 3, nil)
	m := cache.Model{Name: "org/m", Revision: "main", Files: []cache.File{{Path: "w.bin", Descriptor: descOf([]byte("x"))}}}
	nodes[2].res.Put("https://origin/m.json", m)
	any := func(cache.Model) error { return nil }
	got, err := nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/m.json", any)
	require.NoError(t, err)
	require.Equal(t, m, got)

	_, err = nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/other.json", any)
	require.ErrorContains(t, err, "404")
	_, err = nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/m.json", func(cache.Model) error { return errors.New("wrong digest") })
	require.ErrorContains(t, err, "wrong digest")

	// The memory is bounded: the oldest resolution goes first.
	nodes[2].res.Put("b", m)
	nodes[2].res.Put("c", m)
	_, err = nodes[0].swarm.ResolveFromPeers(t.Context(), "https://origin/m.json", any)
	require.Error(t, err)
}

func TestSharedResolveAsksTheOriginOnce(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 4, nil)
	m := cache.Model{Name: "org/m", Revision: strings.Repeat("ab", 20), Files: []cache.File{{Path: "w.bin", Descriptor: descOf([]byte("x"))}}}
	const ref = "hf://org/m@abababababababababababababababababababab"
	var originCalls atomic.Int32
	g, ctx := errgroup.WithContext(t.Context())
	for _, n := range nodes {
		g.Go(func() error {
			got, err := n.swarm.SharedResolve(ctx, ref, func(context.Context) (cache.Model, error) {
				originCalls.Add(1)
				time.Sleep(300 * time.Millisecond) // the origin is slow: the others must wait, not ask too
				n.res.Put(ref, m)
				return m, nil
			}, func(got cache.Model) error {
				if got.Revision != m.Revision {
					return errors.New("wrong revision")
				}
				return nil
			})
			if err == nil && !reflect.DeepEqual(got, m) {
				err = fmt.Errorf("resolved %+v", got)
			}
			return err
		})
	}
	require.NoError(t, g.Wait())
	require.Equal(t, int32(1), originCalls.Load(), "one node asked the origin for the cluster")
}

func TestSharedResolveFallsBackToTheOrigin(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 2, nil)
	m := cache.Model{Name: "org/m", Revision: "main", Files: []cache.File{{Path: "w.bin", Descriptor: descOf([]byte("x"))}}}
	// Find a reference the other node is chosen for, and make its answer
	// unusable: the asking node goes to the origin itself.
	var ref string
	for i := 0; ; i++ {
		ref = fmt.Sprint("hf://org/m@", i)
		if _, other := nodes[0].swarm.resolver(resolutionKey(ref)); other {
			break
		}
	}
	nodes[1].res.Put(ref, m)
	var called bool
	got, err := nodes[0].swarm.SharedResolve(t.Context(), ref, func(context.Context) (cache.Model, error) {
		called = true
		return m, nil
	}, func(cache.Model) error { return errors.New("not the model asked for") })
	require.NoError(t, err)
	require.True(t, called)
	require.Equal(t, m, got)
}

func TestDownloadLimitPacesTheSwarm(t *testing.T) {
	t.Parallel()
	nodes := startSwarmCluster(t, 2, nil)
	data := randomBlob(15, 16*testChunk)
	origin := &countingOrigin{data: data}
	require.NoError(t, nodes[0].fetch(context.Background(), data, origin))
	s, err := NewSwarm(nodes[1].swarm.dir, nil, SwarmConfig{DownloadLimit: 1 << 20}, nil, nil)
	require.NoError(t, err)
	full := s.download.Tokens()
	desc := descOf(data)
	_, err = nodes[1].store.Fetch(context.Background(), desc, s.Source(desc, origin), nil)
	require.NoError(t, err)
	require.Less(t, s.download.Tokens(), full, "every chunk took tokens from the download limiter")
}

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
	_, err = s.fetchChunk(context.Background(), stallingPeer(t, n, 64<<10), d, 0, 300*time.Millisecond, newLiveChunk(n))
	require.ErrorIs(t, err, errSlow)

	f := &fill{s: s, d: d, inflight: map[int]int{}, peers: map[string]*peerView{
		"slow": {name: "slow"}, "dead": {name: "dead"},
	}}
	for range 3 {
		for name, e := range map[string]error{"slow": err, "dead": errors.New("connection refused")} {
			f.inflight[0]++
			f.peers[name].inflight++
			require.NoError(t, f.handle(chunkResult{chunk: 0, peer: name, err: e}))
		}
	}
	require.False(t, s.Banned("slow"))
	require.True(t, f.peers["slow"].busyTill.After(time.Now()), "a slow peer is asked less for a while")
	require.True(t, s.Banned("dead"))

	// A relay's chunk that fails on its way to it is not the relay's
	// fault; a relay that cannot be reached is failing.
	f.peers["relay"] = &peerView{name: "relay", chunkBusy: map[int]time.Time{}}
	f.peers["gone"] = &peerView{name: "gone", chunkBusy: map[int]time.Time{}}
	for range 3 {
		for name, e := range map[string]error{"relay": fmt.Errorf("%w: %w", errRelayCut, io.ErrUnexpectedEOF), "gone": errors.New("connection refused")} {
			f.inflight[0]++
			f.peers[name].inflight++
			require.NoError(t, f.handle(chunkResult{chunk: 0, peer: name, relay: true, err: e}))
		}
	}
	require.False(t, s.Banned("relay"))
	require.True(t, f.peers["relay"].chunkBusy[0].After(time.Now()), "asked for another chunk meanwhile")
	require.True(t, s.Banned("gone"))
}

// An origin fetcher is asked for a chunk it already sent only when no
// other holder of it is free, and, when it is the only holder, once its
// receiver has had time to pass the chunk on.
func TestOriginFetcherIsAskedForSentChunksLast(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	state := func(have byte, sent byte, origin bool) PeerState {
		return PeerState{ChunkState: cache.ChunkState{Size: 3 * testChunk, ChunkSize: testChunk, Have: []byte{have}}, Sent: []byte{sent}, Origin: origin}
	}
	now := time.Now()
	fetcher := &peerView{name: "fetcher", known: true, state: state(0b011, 0b001, true), sentSeen: map[int]time.Time{0: now}}
	other := &peerView{name: "other", known: true, state: state(0b001, 0, false)}
	f := &fill{s: s, inflight: map[int]int{}, peers: map[string]*peerView{"fetcher": fetcher, "other": other}}

	chunk, peer := f.pickFromPeers([]int{0, 1}, false)
	require.Equal(t, 1, chunk, "the unsent chunk")
	require.Same(t, fetcher, peer)
	chunk, peer = f.pickFromPeers([]int{0}, false)
	require.Equal(t, 0, chunk)
	require.Same(t, other, peer, "the other holder, not the fetcher's upload")

	s.requestCounter("other").Store(int32(s.cfg.PerPeer))
	chunk, peer = f.pickFromPeers([]int{0}, false)
	require.Equal(t, 0, chunk)
	require.Same(t, fetcher, peer, "no other holder is free: the fetcher, which sends a repeat when its upload has room")

	delete(f.peers, "other")
	chunk, _ = f.pickFromPeers([]int{0}, false)
	require.Equal(t, -1, chunk, "its receiver passes chunk 0 on soon")
	fetcher.sentSeen[0] = now.Add(-f.holdoff())
	chunk, peer = f.pickFromPeers([]int{0}, false)
	require.Equal(t, 0, chunk, "the receiver had time to pass it on, and did not")
	require.Same(t, fetcher, peer)
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
			_, err = s.fetchChunk(context.Background(), stallingPeer(t, n, sent), d, 0, time.Hour, newLiveChunk(n))
			require.ErrorIs(t, err, errStalled)
			require.Equal(t, sent > 0, errors.Is(err, errSlow), "%v", err)
		})
	}
}

// staticDir is a cluster whose gossip told nothing of who holds what.
type staticDir struct {
	local string
	peers map[string]Peer
}

func (d staticDir) LocalName() string { return d.local }
func (d staticDir) Members() []Peer {
	var ps []Peer
	for _, p := range d.peers {
		ps = append(ps, p)
	}
	return ps
}
func (d staticDir) Peer(name string) (Peer, bool) { p, ok := d.peers[name]; return p, ok }
func (staticDir) Holders(digest.Digest) []Holder  { return nil }

// originGone is an origin that fails every request.
type originGone struct{}

func (originGone) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, errors.New("origin unreachable")
}

// Gossip missed that the member ranked first for a blob holds it: the node
// asks that member directly and fetches from it, where it would otherwise
// take the origin role; the members that hold nothing answer 404.
func TestSwarmAsksTheFirstRankedMembers(t *testing.T) {
	t.Parallel()
	data := randomBlob(18, 3*testChunk)
	d := descOf(data).Digest
	_, holder := serveStore(t, storeHolding(t, data))
	_, empty := serveStore(t, newTestStore(t))
	dir := staticDir{local: "me", peers: map[string]Peer{}}
	first := slices.DeleteFunc(rendezvous(d, []string{"me", "a", "b", "c"}), func(n string) bool { return n == "me" })[0]
	for _, name := range []string{"a", "b", "c"} {
		addr := empty.URL
		if name == first {
			addr = holder.URL
		}
		dir.peers[name] = Peer{Name: name, Meta: NodeMeta{ChunkAddr: strings.TrimPrefix(addr, "http://")}}
	}
	s, err := NewSwarm(dir, nil, SwarmConfig{Settle: 100 * time.Millisecond}, nil, nil)
	require.NoError(t, err)
	store := newTestStore(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = store.Fetch(ctx, descOf(data), s.Source(descOf(data), originGone{}), nil)
	require.NoError(t, err, "fetched from the first-ranked member, not the origin")
	require.False(t, s.FetchesFromOrigin(d))
}

// A holder serves one requester PerPeer chunks at once and refuses more:
// the fills of an image's layers share that allowance, so one fill's
// requests to a peer keep the others from asking it too.
func TestPerPeerRequestsAcrossFills(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	holder := &peerView{name: "holder", known: true,
		state: PeerState{ChunkState: cache.ChunkState{Size: 4 * testChunk, ChunkSize: testChunk, Have: []byte{0b1111}}}}
	layer2 := &fill{s: s, inflight: map[int]int{}, asked: map[int]string{}, peers: map[string]*peerView{"holder": holder}}
	now := time.Now()
	pick, _ := layer2.supplierOf(0, false, now)
	require.NotNil(t, pick, "the holder is free")

	s.requestCounter("holder").Add(int32(s.cfg.PerPeer))
	pick, _ = layer2.supplierOf(0, false, now)
	require.Nil(t, pick, "layer 1's requests take the holder's allowance for this node")
	s.requestCounter("holder").Add(-1)
	pick, _ = layer2.supplierOf(0, false, now)
	require.NotNil(t, pick, "one of layer 1's requests ended")
}

// An origin fetcher with chunks left to fetch from the origin keeps most of
// its downlink for them: only fetcherPeerRequests requests go to peers.
func TestOriginFetcherBoundsItsPeerRequests(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	other := &peerView{name: "other", known: true, inflight: fetcherPeerRequests,
		state: PeerState{ChunkState: cache.ChunkState{Size: 4 * testChunk, ChunkSize: testChunk, Have: []byte{0b0001}}}}
	f := &fill{s: s, inflight: map[int]int{}, peers: map[string]*peerView{"other": other}}
	missing := []int{0, 1, 2, 3}

	require.True(t, f.mayAskPeers(fetcherPeerRequests, missing), "not an origin fetcher")
	f.originRole = true
	require.False(t, f.mayAskPeers(fetcherPeerRequests, missing), "chunks 1 to 3 are still to come from the origin")
	other.inflight--
	require.True(t, f.mayAskPeers(fetcherPeerRequests-1, missing), "under the bound")
	other.inflight++
	other.state.Have = []byte{0b1111}
	require.True(t, f.mayAskPeers(fetcherPeerRequests, missing), "a peer holds every chunk: no origin work left")
	f.originInflight = 1
	require.False(t, f.mayAskPeers(fetcherPeerRequests+1, missing), "a request to the origin is still in flight")
}

// A node among the first OriginFetchers of all members in a blob's order
// takes the origin role at once and may ask the origin straight away; the
// others wait their turn.
func TestFirstRankedMemberTakesTheOriginRoleAtOnce(t *testing.T) {
	t.Parallel()
	names := []string{"me", "a", "b", "c"}
	dir := staticDir{local: "me", peers: map[string]Peer{}}
	for _, n := range names[1:] {
		dir.peers[n] = Peer{Name: n, Meta: NodeMeta{ChunkAddr: "127.0.0.1:1"}}
	}
	s, err := NewSwarm(dir, nil, SwarmConfig{Settle: time.Hour}, nil, nil)
	require.NoError(t, err)
	for i := range 8 {
		d := descOf(randomBlob(uint64(30+i), testChunk)).Digest
		rank := slices.Index(rendezvous(d, names), "me")
		f := &fill{s: s, d: d, start: time.Now(), peers: map[string]*peerView{}, maxInFlight: 8}
		f.decideOrigin()
		require.Equal(t, rank < s.cfg.OriginFetchers, f.originRole, "rank %d of %d", rank, len(names))
		require.Equal(t, f.originRole, f.useOrigin(), "rank %d: no node can rank above it, nothing to wait for", rank)
	}
}

// An origin fetcher takes its own share from the front; with its share done
// it takes another fetcher's from the back (where the origin is slow enough
// for word of requests to keep up), and neither fetches a chunk the other
// says it is fetching.
func TestOriginFetchersMeetFromOppositeEnds(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	d := descOf(randomBlob(40, testChunk)).Digest
	other := &peerView{name: "other", known: true,
		state: PeerState{ChunkState: cache.ChunkState{Size: 8 * testChunk, ChunkSize: testChunk, Have: []byte{0}}, Origin: true}}
	f := &fill{s: s, d: d, inflight: map[int]int{}, peers: map[string]*peerView{"other": other}, originRole: true}
	share, fetchers := f.originShare()
	require.Len(t, fetchers, 2)
	var mine, theirs []int
	for i := range 8 {
		if i%2 == share {
			mine = append(mine, i)
		} else {
			theirs = append(theirs, i)
		}
	}
	all := []int{0, 1, 2, 3, 4, 5, 6, 7}

	require.Equal(t, mine[0], f.nextFromOrigin(slices.Clone(all)), "its own share, from the front")
	other.state.Fetching = setBit(nil, mine[0], true)
	require.Equal(t, mine[1], f.nextFromOrigin(slices.Clone(all)), "not what the other fetches")

	other.state.Fetching = setBit(nil, theirs[0], true)
	f.originTime = time.Millisecond
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(theirs)), "its share done; the origin sends a chunk sooner than word of a request travels")
	f.originTime = time.Second
	require.Equal(t, theirs[3], f.nextFromOrigin(slices.Clone(theirs)), "its share done: the other's, from the back")
	f.inflight[theirs[3]] = 1
	other.state.Have = setBit([]byte{0}, theirs[1], true)
	require.Equal(t, -1, f.nextFromOrigin(slices.Clone(theirs)), "the other's next two chunks are left to it")
}

// A relayed chunk is checked against an origin fetcher's hash, once word
// of it comes; without a fetcher to follow, against the relay's own hash
// at once.
func TestRelayedChunkWaitsForTheFetchersHash(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(nil, nil, SwarmConfig{}, nil, nil)
	require.NoError(t, err)
	hash := func(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }
	st := cache.ChunkState{Size: 3 * testChunk, ChunkSize: testChunk, Have: []byte{0}, Hashes: make([]byte, 3*32)}
	fetcher := &peerView{name: "fetcher", known: true, state: PeerState{ChunkState: st, Origin: true, Fetching: []byte{0b1}}}
	relay := &peerView{name: "relay", known: true, state: PeerState{ChunkState: st}}
	f := &fill{s: s, peers: map[string]*peerView{"fetcher": fetcher, "relay": relay}}
	answer := func(reply chan []byte) []byte {
		select {
		case h := <-reply:
			return h
		default:
			t.Fatal("not answered")
			return nil
		}
	}
	ask := func(i int, claim []byte) chan []byte {
		q := hashQuery{chunk: i, from: "relay", claim: claim, since: time.Now(), reply: make(chan []byte, 1)}
		f.hashWaits = append(f.hashWaits, q)
		f.answerHashes()
		return q.reply
	}
	lied, onTheWay := ask(0, hash(9)), ask(0, hash(1))
	require.Len(t, f.hashWaits, 2, "the fetcher's word is due")

	fetcher.state.Have, fetcher.state.Fetching = []byte{0b1}, []byte{0}
	copy(fetcher.state.Hashes, hash(1))
	f.answerHashes()
	require.Empty(t, f.hashWaits)
	require.Equal(t, hash(1), answer(onTheWay))
	require.Equal(t, hash(1), answer(lied), "the fetcher's, not the relay's")
	require.Equal(t, 1.0, testutil.ToFloat64(s.m.mismatches))

	delete(f.peers, "fetcher") // a blob a peer holds whole, say
	require.Equal(t, hash(2), answer(ask(1, hash(2))), "no fetcher to hear from: the relay's word")
}

// A fill that ends lets the origin role linger for its peers; a later fill
// of the same blob that takes the role keeps it when the first one's
// lingering ends.
func TestOriginRoleOutlivesAnEarlierFillsLinger(t *testing.T) {
	t.Parallel()
	s, err := NewSwarm(staticDir{local: "me"}, nil, SwarmConfig{OriginLinger: 20 * time.Millisecond}, nil, nil)
	require.NoError(t, err)
	d := descOf(randomBlob(40, testChunk)).Digest
	first := &fill{s: s, d: d, start: time.Now(), peers: map[string]*peerView{}, maxInFlight: 8}
	first.decideOrigin()
	require.True(t, first.originRole, "alone, it fetches from the origin")
	first.release() // failed: the download is retried
	retry := &fill{s: s, d: d, start: time.Now(), peers: map[string]*peerView{}, maxInFlight: 8}
	retry.decideOrigin()
	require.True(t, retry.originRole)
	time.Sleep(100 * time.Millisecond)
	require.True(t, s.FetchesFromOrigin(d), "the retry still fetches from the origin, and peers must see it")
	retry.release()
	require.Eventually(t, func() bool { return !s.FetchesFromOrigin(d) }, 5*time.Second, 10*time.Millisecond)
}
