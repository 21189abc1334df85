package adversary

// The agents the attacks of slow readers and big answers (attack 8) are
// aimed at: a chunk server started as internal/agent starts it, and a swarm
// downloader that fetches a blob from peers, on real TCP over loopback.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/p2p"
)

// agentMaxUploads is cmd/weightd's default --max-uploads.
const agentMaxUploads = 6

// servingAgent is one agent's chunk server, started as internal/agent starts
// it: ListenChunks, NewChunkServer with its swarm, upload slots and
// resolutions, Run until the test ends.
type servingAgent struct {
	addr  string
	store *cache.Store
	swarm *p2p.Swarm
}

// startServingAgent starts an agent whose store holds blobs whole, in
// chunks of chunkSize.
func startServingAgent(tb testing.TB, chunkSize int64, blobs [][]byte, opts ...p2p.ServerOption) *servingAgent {
	tb.Helper()
	store := openStore(tb, chunkSize)
	for _, b := range blobs {
		desc := content.Descriptor{Digest: digest.FromBytes(b), Size: int64(len(b))}
		_, err := store.Fetch(context.Background(), desc, cache.Bytes(b), nil)
		require.NoError(tb, err)
	}
	return serveStore(tb, store, opts...)
}

// serveStore runs an agent's chunk server over store.
func serveStore(tb testing.TB, store *cache.Store, opts ...p2p.ServerOption) *servingAgent {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ln, err := p2p.ListenChunks(ctx, "127.0.0.1:0", "", nil)
	require.NoError(tb, err)
	sw, err := p2p.NewSwarm(staticDirectory{local: "server"}, nil, p2p.SwarmConfig{}, nil, nil)
	require.NoError(tb, err)
	srv, err := p2p.NewChunkServer(store, prometheus.NewRegistry(), append([]p2p.ServerOption{
		p2p.WithSwarm(sw), p2p.WithMaxUploads(agentMaxUploads), p2p.WithResolutions(p2p.NewResolutions(16)),
	}, opts...)...)
	require.NoError(tb, err)
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx, ln) }()
	tb.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			tb.Errorf("chunk server: %v", err)
		}
	})
	return &servingAgent{addr: ln.Addr().String(), store: store, swarm: sw}
}

func openStore(tb testing.TB, chunkSize int64) *cache.Store {
	tb.Helper()
	store, err := cache.Open(tb.TempDir(), cache.WithChunkSize(chunkSize), cache.WithBudget(0, 0))
	require.NoError(tb, err)
	tb.Cleanup(func() { store.Close() })
	return store
}

// staticDirectory is a cluster whose members hold every blob whole.
type staticDirectory struct {
	local string
	peers map[string]string // name → chunk server address
}

func (d staticDirectory) LocalName() string { return d.local }

func (d staticDirectory) Members() []p2p.Peer {
	var out []p2p.Peer
	for name := range d.peers {
		p, _ := d.Peer(name)
		out = append(out, p)
	}
	return out
}

func (d staticDirectory) Peer(name string) (p2p.Peer, bool) {
	addr, ok := d.peers[name]
	return p2p.Peer{Name: name, GossipAddr: addr, Meta: p2p.NodeMeta{ChunkAddr: addr}}, ok
}

func (d staticDirectory) Holders(digest.Digest) []p2p.Holder {
	var out []p2p.Holder
	for name := range d.peers {
		out = append(out, p2p.Holder{Peer: name, Complete: true, Seen: time.Now()})
	}
	return out
}

// fetchingAgent is an agent downloading blobs from its peers with the
// swarm, configured as internal/agent configures it; its log is kept.
type fetchingAgent struct {
	store *cache.Store
	swarm *p2p.Swarm
	log   *lockedBuffer
}

func newFetchingAgent(tb testing.TB, chunkSize int64, peers map[string]string) *fetchingAgent {
	tb.Helper()
	log := &lockedBuffer{}
	sw, err := p2p.NewSwarm(staticDirectory{local: "fetcher", peers: peers}, nil, p2p.SwarmConfig{},
		slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})), nil)
	require.NoError(tb, err)
	return &fetchingAgent{store: openStore(tb, chunkSize), swarm: sw, log: log}
}

// fetch downloads blob from the peers alone (the origin refuses) and
// checks the bytes stored.
func (a *fetchingAgent) fetch(ctx context.Context, blob []byte) error {
	if err := a.download(ctx, blob); err != nil {
		return err
	}
	return a.check(blob)
}

// download downloads blob from the peers alone: the origin refuses.
func (a *fetchingAgent) download(ctx context.Context, blob []byte) error {
	desc := content.Descriptor{Digest: digest.FromBytes(blob), Size: int64(len(blob))}
	_, err := a.store.Fetch(ctx, desc, a.swarm.Source(desc, p2p.Origin{RangeOpener: refusingOrigin{}}), nil)
	return err
}

// check checks that the store holds blob.
func (a *fetchingAgent) check(blob []byte) error {
	f, err := a.store.Open(digest.FromBytes(blob))
	if err != nil {
		return err
	}
	defer f.Close()
	got, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, blob) {
		return errors.New("stored bytes differ from the blob")
	}
	return nil
}

// refusingOrigin is an origin that cannot be reached: blobs come from peers.
type refusingOrigin struct{}

func (refusingOrigin) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, errors.New("origin unreachable: this blob must come from peers")
}

func randomBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), 8}).Read(b)
	return b
}

// lockedBuffer is a bytes.Buffer safe for concurrent use.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// chunkURL is the path of chunk i of d on a chunk server.
func chunkURL(d digest.Digest, i int) string { return fmt.Sprintf("/v1/blobs/%s/chunks/%d", d, i) }
