package p2p

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/peertls"
)

// serveTLS runs a chunk server of store over mutual TLS as the agent runs
// it (ChunkServer.Run with WithTLS), with identity id, and returns its
// address.
func serveTLS(t *testing.T, store ChunkStore, id *peertls.Identity, opts ...ServerOption) string {
	t.Helper()
	srv, err := NewChunkServer(store, nil, append(opts, WithTLS(id.ServerConfig()))...)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return ln.Addr().String()
}

// identities mints an identity per name from one new CA.
func identities(t *testing.T, names ...string) map[string]*peertls.Identity {
	t.Helper()
	ca, err := peertls.WriteCA(t.TempDir(), "test CA")
	require.NoError(t, err)
	ids := map[string]*peertls.Identity{}
	for _, n := range names {
		id, err := peertls.New(n, ca)
		require.NoError(t, err)
		ids[n] = id
	}
	return ids
}

// Peers holding a blob serve it over mutual TLS: a swarm with the
// cluster's identity downloads it from them alone, chunk states, relays
// and resolutions included; plain HTTP gets no answer.
func TestSwarmOverMutualTLS(t *testing.T) {
	t.Parallel()
	ids := identities(t, "a", "b", "me")
	data := randomBlob(31, 5*testChunk+100)
	res := NewResolutions(2)
	res.Put("hf://org/model@main", content.Model{Name: "org/model", Revision: "0123456789abcdef0123456789abcdef01234567"})
	dir := staticDir{local: "me", peers: map[string]Peer{
		"a": {Name: "a", Meta: NodeMeta{ChunkAddr: serveTLS(t, storeHolding(t, data), ids["a"], WithResolutions(res))}},
		"b": {Name: "b", Meta: NodeMeta{ChunkAddr: serveTLS(t, storeHolding(t, data), ids["b"])}},
	}}
	s, err := NewSwarm(holdersDir{dir}, nil, SwarmConfig{Settle: 100 * time.Millisecond, TLS: ids["me"].ClientConfig()}, nil, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store := newTestStore(t)
	_, err = store.Fetch(ctx, descOf(data), s.Source(descOf(data), Origin{RangeOpener: originGone{}}), nil)
	require.NoError(t, err, "fetched from the peers over TLS")

	m, err := s.askResolution(ctx, dir.peers["a"].Meta.ChunkAddr, resolutionKey("hf://org/model@main"))
	require.NoError(t, err)
	require.Equal(t, "org/model", m.Name)

	resp, err := http.Get("http://" + dir.peers["a"].Meta.ChunkAddr + resolutionPrefix + resolutionKey("hf://org/model@main"))
	if err == nil {
		resp.Body.Close()
		require.NotEqual(t, http.StatusOK, resp.StatusCode, "plain HTTP was answered")
	}
}

// A chunk server whose certificate names another node than the member that
// advertises its address, or an address two members advertise, is not
// believed: a member cannot answer under a name it chose.
func TestSwarmRefusesAnotherNodesServer(t *testing.T) {
	t.Parallel()
	ids := identities(t, "a", "evil", "me")
	data := randomBlob(32, 2*testChunk)
	evil := serveTLS(t, storeHolding(t, data), ids["evil"])
	cases := map[string]map[string]Peer{
		"a member advertising another node's server": {
			"a": {Name: "a", Meta: NodeMeta{ChunkAddr: evil}},
		},
		"a second name on a node's server": {
			"evil":  {Name: "evil", Meta: NodeMeta{ChunkAddr: evil}},
			"alias": {Name: "alias", Meta: NodeMeta{ChunkAddr: evil}},
		},
	}
	for name, peers := range cases {
		t.Run(name, func(t *testing.T) {
			s, err := NewSwarm(staticDir{local: "me", peers: peers}, nil, SwarmConfig{TLS: ids["me"].ClientConfig()}, nil, nil)
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_, err = s.fetchChunk(ctx, evil, descOf(data).Digest, 0, time.Minute, false, false, newLiveChunk(testChunk))
			require.ErrorIs(t, err, errNotThePeer)
		})
	}

	// The same server is believed for its own member.
	s, err := NewSwarm(staticDir{local: "me", peers: map[string]Peer{"evil": {Name: "evil", Meta: NodeMeta{ChunkAddr: evil}}}},
		nil, SwarmConfig{TLS: ids["me"].ClientConfig()}, nil, nil)
	require.NoError(t, err)
	_, err = s.fetchChunk(context.Background(), evil, descOf(data).Digest, 0, time.Minute, false, false, newLiveChunk(testChunk))
	require.NoError(t, err)

	// A swarm without the cluster's certificate gets nothing from it.
	outsider, err := NewSwarm(staticDir{local: "me", peers: map[string]Peer{"evil": {Name: "evil", Meta: NodeMeta{ChunkAddr: evil}}}},
		nil, SwarmConfig{TLS: &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13}}, nil, nil)
	require.NoError(t, err)
	_, err = outsider.fetchChunk(context.Background(), evil, descOf(data).Digest, 0, time.Minute, false, false, newLiveChunk(testChunk))
	require.Error(t, err)
	require.False(t, errors.Is(err, errNotThePeer), "refused at the handshake: %v", err)
}

// holdersDir is a staticDir whose members all hold every blob whole.
type holdersDir struct{ staticDir }

func (d holdersDir) Holders(digest.Digest) []Holder {
	var hs []Holder
	for name := range d.peers {
		hs = append(hs, Holder{Peer: name, Complete: true, Seen: time.Now()})
	}
	return hs
}
