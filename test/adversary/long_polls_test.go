package adversary

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// Attack 8, state long-polls: a chunk state request may wait up to 2 s for
// news, and the server looked for news every 20 ms by copying the blob's
// whole state, its hash list included: 50 copies of up to 512 MiB of hashes
// a second per waiting request, which any client can open by the hundred.
// Looking for news must not copy the hash list: a poll that waits a second
// without news allocates about what its one answer takes, not 50 times it.
func TestStateLongPollCopiesNoHashList(t *testing.T) {
	const chunk, chunks, present = 64 << 10, 4096, 100
	desc := content.Descriptor{Digest: digest.FromString("a blob still downloading"), Size: chunks * chunk}
	store := openStore(t, chunk)
	ctx, cancel := context.WithCancel(context.Background())
	fetched := make(chan error, 1)
	go func() {
		_, err := store.Fetch(ctx, desc, &stuckDownload{chunks: present}, nil)
		fetched <- err
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-fetched; !errors.Is(err, context.Canceled) {
			t.Errorf("download: %v", err)
		}
	})
	require.Eventually(t, func() bool {
		st, err := store.ChunkState(desc.Digest)
		return err == nil && countOnes(st.Have) == present
	}, 10*time.Second, 10*time.Millisecond)
	server := serveStore(t, store)

	hashList := int64(chunks * sha256.Size)
	url := fmt.Sprintf("http://%s/v1/blobs/%s/state?since=%d", server.addr, desc.Digest, present)
	poll := func(query string) (took time.Duration, allocated int64) {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		start := time.Now()
		resp, err := http.Get(url + query)
		require.NoError(t, err)
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		took = time.Since(start)
		runtime.ReadMemStats(&after)
		return took, int64(after.TotalAlloc - before.TotalAlloc)
	}
	// least is the fewest bytes, of three requests, that a request with
	// query allocated in the whole process.
	least := func(query string) int64 {
		least := int64(-1)
		for range 3 {
			took, allocated := poll(query)
			if query != "" {
				require.GreaterOrEqual(t, took, 900*time.Millisecond, "no news: the request waits")
			}
			if least < 0 || allocated < least {
				least = allocated
			}
		}
		return least
	}
	poll("")                    // the client's connection
	answer := least("")         // looks once, answers
	waited := least("&wait=1s") // looks every 20 ms for a second, answers
	perLook := (waited - answer) / int64(time.Second/(20*time.Millisecond))
	t.Logf("%d-chunk blob, a %d KiB hash list: an answer at once allocates %d KiB, one after a second of looking for news %d KiB: %d bytes a look",
		chunks, hashList>>10, answer>>10, waited>>10, perLook)
	require.Less(t, waited-answer, hashList, "a second of looking for news, 50 looks, copies less than one hash list")
}

// stuckDownload fills the first chunks of a download and then waits for
// the download to be cancelled: a blob this node is still downloading.
type stuckDownload struct{ chunks int }

func (s *stuckDownload) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, errors.New("no origin")
}

func (s *stuckDownload) Fill(ctx context.Context, p *cache.Partial) error {
	for i := range s.chunks {
		if err := p.WriteChunk(i, make([]byte, p.ChunkLen(i)), nil); err != nil {
			return err
		}
	}
	<-ctx.Done()
	return ctx.Err()
}

func countOnes(b []byte) int {
	n := 0
	for _, x := range b {
		for ; x != 0; x &= x - 1 {
			n++
		}
	}
	return n
}
