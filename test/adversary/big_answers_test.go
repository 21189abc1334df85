package adversary

import (
	"context"
	"encoding/binary"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/p2p"
)

// Attack 8, big answers: a hostile peer answers the chunk-state request
// with a body of hundreds of MiB. The agent read up to ~520 MiB of it and
// decoded it before checking its size against the blob, and asked again
// every 50 ms. It must reject such an answer after reading at most what a
// state of the blob can take, say why, and get the blob from honest peers.
func TestBigStateAnswerDeclared(t *testing.T) {
	// 600 MiB declared in Content-Length, zeros sent until the agent stops
	// reading.
	testBigStateAnswer(t, func(w http.ResponseWriter) {
		const size = 600 << 20
		w.Header().Set("Content-Length", strconv.Itoa(size))
		writeZeros(w, size)
	})
}

func TestBigStateAnswerStreamed(t *testing.T) {
	// No length: up to 1 GiB streamed.
	testBigStateAnswer(t, func(w http.ResponseWriter) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		writeZeros(w, 1<<30)
	})
}

func TestBigStateAnswerWellFormed(t *testing.T) {
	// A well-formed state of a blob of 8 Mi chunks, every chunk present:
	// 257 MiB, the hashes of chunks that do not exist.
	testBigStateAnswer(t, func(w http.ResponseWriter) {
		const chunks, chunkSize = 8 << 20, 64 << 10
		head := append([]byte("WDCS"), 1, 1) // version 1, complete
		head = binary.BigEndian.AppendUint64(head, chunks*chunkSize)
		head = binary.BigEndian.AppendUint64(head, chunkSize)
		have := []byte(strings.Repeat("\xff", chunks/8))
		w.Header().Set("Content-Length", strconv.Itoa(len(head)+len(have)+32*chunks))
		if _, err := w.Write(append(head, have...)); err != nil {
			return
		}
		writeZeros(w, 32*chunks)
	})
}

// stateBound is what the test lets a hostile server write to the agent
// for all its state requests: the state of the blob (a few KiB) and what
// loopback's socket buffers take.
const stateBound = 16 << 20

func testBigStateAnswer(t *testing.T, answer func(http.ResponseWriter)) {
	const chunk = 1 << 20
	blob := randomBytes(3, 16*chunk)
	// The honest peer sends at 8 MiB/s: the fetch lasts about 2 s, time
	// enough for the agent to ask the hostile peer for its state again.
	honest := startServingAgent(t, chunk, [][]byte{blob}, p2p.WithUploadLimit(8<<20))

	var written, asked atomic.Int64
	hostile := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/state") {
			http.NotFound(w, r)
			return
		}
		asked.Add(1)
		answer(countingWriter{w, &written})
	}))
	t.Cleanup(hostile.Close)

	agent := newFetchingAgent(t, chunk, map[string]string{"honest": honest.addr, "hostile": hostile.Listener.Addr().String()})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	require.NoError(t, agent.fetch(ctx, blob), "the blob comes from the honest peer")
	t.Logf("fetch took %v; the hostile peer was asked %d times and wrote %d MiB", time.Since(start).Round(time.Millisecond),
		asked.Load(), written.Load()>>20)
	require.LessOrEqual(t, written.Load(), int64(stateBound), "the agent stops reading a state answer at what a state of the blob can take")
	require.True(t, agent.swarm.Banned("hostile"), "the hostile peer is banned")
	log := agent.log.String()
	require.Contains(t, log, "chunk state too big for the blob", "the agent says why")
	for line := range strings.Lines(log) {
		if strings.Contains(line, "too big") {
			t.Log(strings.TrimSpace(line))
		}
	}
}

// countingWriter counts the bytes of an answer that reached the socket.
type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (c countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.n.Add(int64(n))
	return n, err
}

func (c countingWriter) Flush() { c.ResponseWriter.(http.Flusher).Flush() }

// writeZeros writes n zero bytes to w, until w fails.
func writeZeros(w http.ResponseWriter, n int) {
	buf := make([]byte, 1<<20)
	for n > 0 {
		k, err := w.Write(buf[:min(n, len(buf))])
		n -= k
		if err != nil {
			return
		}
	}
}
