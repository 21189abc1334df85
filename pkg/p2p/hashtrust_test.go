package p2p

import (
	"bytes"
	"context"
	"crypto/sha256"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
)

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
	f := &fill{plan: &plan{s: s, peers: peersOf(fetcher, relay)}}
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

	f.peers.remove("fetcher") // a blob a peer holds whole, say
	require.Equal(t, hash(2), answer(ask(1, hash(2))), "no fetcher to hear from: the relay's word")
}
