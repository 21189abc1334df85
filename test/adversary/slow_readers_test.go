package adversary

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Attack 8, slow readers: a hostile peer opens chunk downloads and reads a
// byte a second, or nothing, so that it holds every upload slot of a chunk
// server that has no write deadline, and no honest peer gets a chunk from
// it. An honest peer's fetch from the same server must complete (a bound
// on waiting, not a speed), and the hostile downloads must be cut.
func TestSlowReadersDoNotStarveHonestPeers(t *testing.T) {
	const chunk = 4 << 20
	blob := randomBytes(1, 8*chunk)
	d := digest.FromBytes(blob)
	server := startServingAgent(t, chunk, [][]byte{blob})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hostile := startSlowClients(ctx, 100, 20*time.Millisecond, hostileIP, server.addr, d, 8)
	// Let them take the slots they can before the honest peer asks.
	require.Eventually(t, func() bool { return hostile.held() >= agentMaxUploads/2 }, 10*time.Second, 10*time.Millisecond,
		"the slow clients start downloads")

	honest := newFetchingAgent(t, chunk, map[string]string{"server": server.addr})
	fctx, fcancel := context.WithTimeout(ctx, 30*time.Second)
	start := time.Now()
	err := honest.fetch(fctx, blob)
	fcancel()
	require.NoError(t, err, "an honest peer's fetch completes within 30 s while 100 slow clients are connected (they hold %d downloads, %d refused)",
		hostile.holding(), hostile.refused())
	t.Logf("honest fetch of %d MiB: %v, with 100 slow clients holding %d downloads (%d refused so far)",
		len(blob)>>20, time.Since(start).Round(time.Millisecond), hostile.holding(), hostile.refused())

	// Every download a slow client got is cut, and its connection with it,
	// within a generous bound: a liveness bound, not a speed.
	const cutBound = 30 * time.Second
	require.Eventually(t, func() bool {
		cut, oldest := hostile.cutAndOldest()
		return cut > 0 && oldest < cutBound
	}, 45*time.Second, 100*time.Millisecond, "the slow clients' downloads are cut")
	cut, held, longest := hostile.cutStats()
	t.Logf("%d of %d slow downloads cut, the longest after %v", cut, held, longest.Round(time.Millisecond))
	require.LessOrEqual(t, longest, cutBound)
}

// BenchmarkHonestFetchWithSlowClients is an honest peer's fetch of a
// 128 MiB blob from an agent, with no other client, and with 100 slow
// clients connected that read a byte a second or nothing, and ask again a
// second after a 503 (slow) or 20 ms after (hammering). The ratio of the
// throughputs is what slow clients cost honest peers; all run on the same
// CPUs here, the clients too.
func BenchmarkHonestFetchWithSlowClients(b *testing.B) {
	const chunk = 4 << 20
	blob := randomBytes(2, 32*chunk)
	d := digest.FromBytes(blob)
	for _, bc := range []struct {
		name    string
		clients int
		retry   time.Duration
	}{
		{"clients=0", 0, 0},
		{"clients=100/slow", 100, time.Second},
		{"clients=100/hammering", 100, 20 * time.Millisecond},
	} {
		clients := bc.clients
		b.Run(bc.name, func(b *testing.B) {
			server := startServingAgent(b, chunk, [][]byte{blob})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if clients > 0 {
				hostile := startSlowClients(ctx, clients, bc.retry, hostileIP, server.addr, d, 8)
				for deadline := time.Now().Add(10 * time.Second); hostile.held() < agentMaxUploads/2; time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						b.Fatal("the slow clients started no downloads")
					}
				}
			}
			b.SetBytes(int64(len(blob)))
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				honest := newFetchingAgent(b, chunk, map[string]string{"server": server.addr})
				b.StartTimer()
				fctx, fcancel := context.WithTimeout(ctx, 30*time.Second)
				err := honest.download(fctx, blob)
				fcancel()
				b.StopTimer()
				if err == nil {
					err = honest.check(blob)
				}
				if err != nil {
					b.Fatalf("honest fetch with %d slow clients: %v", clients, err)
				}
				b.StartTimer()
			}
		})
	}
}

// hostileIP is the loopback address the hostile clients come from; honest
// peers come from 127.0.0.1.
var hostileIP = net.IPv4(127, 0, 0, 2)

// slowClients are hostile clients that ask for chunks until the server
// starts sending one, again retry after each refusal, then read a byte a
// second (half of them) or nothing (the others) for as long as the server
// keeps the connection.
type slowClients struct {
	mu    sync.Mutex
	holds []*slowHold // the downloads the server started to them
	busy  int         // requests refused (503)
	retry time.Duration
}

// slowHold is one download the server started to a slow client.
type slowHold struct {
	start time.Time
	cut   time.Time // when the server cut the connection; zero while it is up
}

func startSlowClients(ctx context.Context, n int, retry time.Duration, src net.IP, addr string, d digest.Digest, chunks int) *slowClients {
	c := &slowClients{retry: retry}
	for k := range n {
		go c.run(ctx, k%2 == 0, src, addr, d, k%chunks)
	}
	return c
}

func (c *slowClients) run(ctx context.Context, trickle bool, src net.IP, addr string, d digest.Digest, i int) {
	for ctx.Err() == nil {
		conn, err := dialFrom(ctx, src, addr, 4<<10)
		if err != nil {
			sleepCtx(ctx, 50*time.Millisecond)
			continue
		}
		c.hold(ctx, conn, trickle, d, i)
		conn.Close()
	}
}

// hold asks for chunk i on conn until the server starts sending it, then
// reads it a byte a second (trickle) or not at all, until the server cuts
// the connection or ctx ends.
func (c *slowClients) hold(ctx context.Context, conn *net.TCPConn, trickle bool, d digest.Digest, i int) {
	br := bufio.NewReaderSize(conn, 512)
	for ctx.Err() == nil {
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: weightd\r\n\r\n", chunkURL(d, i)); err != nil {
			return
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return
		}
		if resp.StatusCode != http.StatusOK {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			c.mu.Lock()
			c.busy++
			c.mu.Unlock()
			if resp.Close {
				return
			}
			sleepCtx(ctx, c.retry)
			continue
		}
		conn.SetDeadline(time.Time{})
		h := &slowHold{start: time.Now()}
		c.mu.Lock()
		c.holds = append(c.holds, h)
		c.mu.Unlock()
		if trickle {
			go func() {
				one := make([]byte, 1)
				for {
					if _, err := resp.Body.Read(one); err != nil || !sleepCtx(ctx, time.Second) {
						return
					}
				}
			}()
		}
		// Its buffers stay full: only the TCP state tells that the server
		// cut the connection.
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if st, err := tcpState(conn); err != nil || st != tcpEstablished {
				c.mu.Lock()
				h.cut = time.Now()
				c.mu.Unlock()
				return
			}
		}
	}
}

// held is how many downloads the server started to the slow clients.
func (c *slowClients) held() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.holds)
}

// holding is how many of them are still going.
func (c *slowClients) holding() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, h := range c.holds {
		if h.cut.IsZero() {
			n++
		}
	}
	return n
}

func (c *slowClients) refused() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.busy
}

// cutAndOldest is how many downloads were cut, and how long the oldest
// one still going has been.
func (c *slowClients) cutAndOldest() (cut int, oldest time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, h := range c.holds {
		if !h.cut.IsZero() {
			cut++
		} else {
			oldest = max(oldest, time.Since(h.start))
		}
	}
	return cut, oldest
}

// cutStats is how many downloads were cut, of how many, and the longest
// a download lasted before its cut.
func (c *slowClients) cutStats() (cut, held int, longest time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, h := range c.holds {
		if !h.cut.IsZero() {
			cut++
			longest = max(longest, h.cut.Sub(h.start))
		}
	}
	return cut, len(c.holds), longest
}

// sleepCtx sleeps for d; false if ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// dialFrom dials addr over TCP from the local address ip, with a receive
// buffer of rcvbuf bytes (the kernel doubles it): a slow reader's window.
func dialFrom(ctx context.Context, ip net.IP, addr string, rcvbuf int) (*net.TCPConn, error) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: ip}, Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, rcvbuf) })
		return errors.Join(err, serr)
	}}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// tcpEstablished is Linux's TCP_ESTABLISHED state.
const tcpEstablished = 1

// tcpState is the kernel's TCP state of conn.
func tcpState(conn *net.TCPConn) (uint8, error) {
	raw, err := conn.SyscallConn()
	if err != nil {
		return 0, err
	}
	var info *unix.TCPInfo
	var ierr error
	if err := raw.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil {
		return 0, err
	}
	if ierr != nil {
		return 0, ierr
	}
	return info.State, nil
}
