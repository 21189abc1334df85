package adversary

// Attack 8, sent-once marks: an origin fetcher sends each chunk once per
// resendAfter while more than half its upload slots are busy, and refuses
// it to everyone else in that time ("ask its receiver"). Hostile peers that
// hold over half its slots with slow downloads, and ask again for every
// chunk the moment its window ends, are always its receiver: an honest
// peer that the origin fetcher alone can serve never gets the chunks.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/p2p"
)

func TestSentOnceMarksDoNotStarveHonestPeers(t *testing.T) {
	const (
		chunk   = 4 << 20
		chunks  = 8
		held    = chunks - 1 // chunks the origin fetcher has; the origin holds back the last
		slots   = 12
		perPeer = 4
	)
	blob := randomBytes(3, chunks*chunk)
	d := digest.FromBytes(blob)
	desc := content.Descriptor{Digest: d, Size: int64(len(blob))}
	server := serveStore(t, openStore(t, chunk), p2p.WithMaxUploads(slots), p2p.WithMaxUploadsPerPeer(perPeer))
	ctx, cancel := context.WithCancel(context.Background())
	filled := make(chan struct{})
	t.Cleanup(func() { cancel(); <-filled })
	go func() {
		defer close(filled)
		_, _ = server.store.Fetch(ctx, desc, server.swarm.Source(desc, p2p.Origin{RangeOpener: stallingOrigin{blob: blob, upTo: held * chunk}}), nil)
	}()
	require.Eventually(t, func() bool { return server.swarm.FetchesFromOrigin(d) }, 10*time.Second, 10*time.Millisecond,
		"the server fetches the blob from the origin")

	// Two hostile addresses hold 7 of the 12 slots with downloads they read
	// at 128 KiB/s (fast enough never to be cut), a third asks for each
	// chunk every 20 ms and reads it whole.
	slow := &steadyReaders{}
	for k := range 3 * perPeer {
		go slow.run(ctx, net.IPv4(127, 0, 0, byte(2+k%2)), server.addr, d, k%held)
	}
	require.Eventually(t, func() bool { return slow.holding() >= slots/2+1 }, 20*time.Second, 10*time.Millisecond,
		"the slow readers hold over half the slots")
	for i := range held {
		go askAgain(ctx, clientFrom(net.IPv4(127, 0, 0, 4)), "http://"+server.addr+chunkURL(d, i), 20*time.Millisecond)
	}

	// An honest peer asks for each chunk the origin fetcher has, every
	// 200 ms, until it gets it; three windows of resendAfter is its bound (a
	// bound on waiting, not a speed).
	honest := clientFrom(net.IPv4(127, 0, 0, 1))
	start := time.Now()
	var wg sync.WaitGroup
	got := make([]time.Duration, held)
	for i := range held {
		wg.Go(func() {
			hctx, hcancel := context.WithTimeout(ctx, 30*time.Second)
			defer hcancel()
			for hctx.Err() == nil {
				if b, err := getAll(hctx, honest, "http://"+server.addr+chunkURL(d, i)); err == nil && bytes.Equal(b, blob[i*chunk:(i+1)*chunk]) {
					got[i] = time.Since(start)
					return
				}
				sleepCtx(hctx, 200*time.Millisecond)
			}
		})
	}
	wg.Wait()
	require.True(t, server.swarm.FetchesFromOrigin(d), "the server still fetches from the origin: its sent-once rule held throughout")
	t.Logf("the honest peer's chunks came after %v, with %d slow downloads under way", got, slow.holding())
	for i, took := range got {
		require.NotZero(t, took, "the honest peer gets chunk %d within 30 s", i)
	}
}

// stallingOrigin sends a blob's bytes up to upTo at once, the rest 1 KiB
// every 100 ms: an origin fetch that stays under way.
type stallingOrigin struct {
	blob []byte
	upTo int
}

func (o stallingOrigin) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	head := bytes.NewReader(o.blob[min(int(off), o.upTo):o.upTo])
	tail := &trickle{ctx: ctx, b: o.blob[max(int(off), o.upTo):]}
	return io.NopCloser(io.MultiReader(head, tail)), nil
}

// trickle reads b 1 KiB every 100 ms, until ctx ends.
type trickle struct {
	ctx context.Context
	b   []byte
}

func (t *trickle) Read(p []byte) (int, error) {
	if len(t.b) == 0 {
		return 0, io.EOF
	}
	if !sleepCtx(t.ctx, 100*time.Millisecond) {
		return 0, t.ctx.Err()
	}
	n := copy(p, t.b[:min(len(t.b), 1<<10)])
	t.b = t.b[n:]
	return n, nil
}

// steadyReaders ask for a chunk until the server starts sending it, then
// read it at 128 KiB/s (fast enough never to be cut), and ask again when
// it is done.
type steadyReaders struct {
	mu   sync.Mutex
	busy int // downloads being read
}

func (s *steadyReaders) run(ctx context.Context, src net.IP, addr string, d digest.Digest, i int) {
	// A small receive window keeps the chunk in the server's hands, and
	// its upload slot taken, while it is read.
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
		return dialFrom(ctx, src, addr, 4<<10)
	}}}
	for ctx.Err() == nil {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+chunkURL(d, i), nil)
		resp, err := c.Do(req)
		if err != nil {
			sleepCtx(ctx, 50*time.Millisecond)
			continue
		}
		if resp.StatusCode != http.StatusOK {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			sleepCtx(ctx, 20*time.Millisecond)
			continue
		}
		s.add(1)
		buf := make([]byte, 32<<10)
		for ctx.Err() == nil {
			if _, err := io.ReadFull(resp.Body, buf); err != nil {
				break
			}
			sleepCtx(ctx, 250*time.Millisecond)
		}
		resp.Body.Close()
		s.add(-1)
	}
}

func (s *steadyReaders) add(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.busy += n
}

func (s *steadyReaders) holding() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.busy
}

// askAgain gets url every gap, reading each answer whole.
func askAgain(ctx context.Context, c *http.Client, url string, gap time.Duration) {
	for ctx.Err() == nil {
		_, _ = getAll(ctx, c, url)
		sleepCtx(ctx, gap)
	}
}

// getAll is the body of a 200 answer to a GET of url.
func getAll(ctx context.Context, c *http.Client, url string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s", url, resp.Status)
	}
	return b, err
}

// clientFrom is an HTTP client whose connections come from ip.
func clientFrom(ip net.IP) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}}
	return &http.Client{Transport: &http.Transport{DialContext: d.DialContext, MaxIdleConnsPerHost: 16}}
}
