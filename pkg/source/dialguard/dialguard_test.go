package dialguard_test

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/dialguard"
)

func TestGuardCheck(t *testing.T) {
	t.Parallel()
	allow, err := dialguard.ParseAllowList([]string{"127.0.0.2", "169.254.7.0/24"})
	require.NoError(t, err)
	g := dialguard.New(allow)
	for _, tt := range []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1", false},
		{"127.0.0.2", true}, // allowed
		{"::1", false},
		{"::ffff:127.0.0.1", false},
		{"169.254.169.254", false},
		{"169.254.7.9", true}, // allowed
		{"fe80::1%eth0", false},
		{"0.0.0.0", false},
		{"0.1.2.3", false},
		{"::", false},
		{"fd00:ec2::254", false},
		{"100.100.100.200", false},
		{"10.1.2.3", true},
		{"192.168.0.10", true},
		{"fd12::1", true},
		{"192.0.2.1", true},
		{"2001:db8::1", true},
	} {
		err := g.Check(netip.MustParseAddr(tt.addr))
		if tt.ok {
			require.NoError(t, err, tt.addr)
			continue
		}
		require.ErrorIs(t, err, dialguard.ErrAddressRefused, tt.addr)
		require.ErrorIs(t, err, content.ErrPermanent, tt.addr)
	}
}

func TestGuardRefusesOwnAddresses(t *testing.T) {
	t.Parallel()
	addrs, err := net.InterfaceAddrs()
	require.NoError(t, err)
	g := dialguard.New(nil)
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.(*net.IPNet).IP)
		require.ErrorIs(t, g.Check(ip.Unmap()), dialguard.ErrAddressRefused, "%s is this machine's", ip)
	}
}

func TestParseAllowList(t *testing.T) {
	t.Parallel()
	got, err := dialguard.ParseAllowList([]string{"10.0.0.0/8", " 192.0.2.7 ", "fd00::1/8", "::1"})
	require.NoError(t, err)
	require.Equal(t, []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.0.2.7/32"),
		netip.MustParsePrefix("fd00::/8"), netip.MustParsePrefix("::1/128"),
	}, got)
	for _, bad := range []string{"", "10.0.0.0/33", "example.com", "::ffff:10.0.0.0/104"} {
		_, err := dialguard.ParseAllowList([]string{bad})
		require.Error(t, err, bad)
	}
}

// A redirect from an allowed origin to a refused one is refused when the
// second connection is dialled, a name resolving to a refused address is
// refused, and a trusted host:port is dialled as is.
func TestGuardRedirect(t *testing.T) {
	t.Parallel()
	var hits atomic.Int64
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { hits.Add(1) }))
	t.Cleanup(target.Close)
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Skipf("no 127.0.0.2 here: %v", err)
	}
	front := &httptest.Server{Listener: ln, Config: &http.Server{Handler: http.RedirectHandler(target.URL+"/x", http.StatusFound)}}
	front.Start()
	t.Cleanup(front.Close)

	g := dialguard.New([]netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")})
	c := &http.Client{Transport: g.Transport()}
	_, err = c.Get(front.URL)
	require.ErrorIs(t, err, dialguard.ErrAddressRefused)
	require.Zero(t, hits.Load())

	// A name is checked on what it resolves to.
	_, port, err := net.SplitHostPort(target.Listener.Addr().String())
	require.NoError(t, err)
	_, err = c.Get("http://localhost:" + port + "/")
	require.ErrorIs(t, err, dialguard.ErrAddressRefused)
	require.Zero(t, hits.Load())

	trusted := dialguard.New([]netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")}, target.Listener.Addr().String())
	resp, err := (&http.Client{Transport: trusted.Transport()}).Get(front.URL)
	require.NoError(t, err)
	resp.Body.Close()
	require.EqualValues(t, 1, hits.Load())
}

// BenchmarkGuardCheck is the guard's cost per new connection to an
// acceptable address: it lists the node's addresses each time.
func BenchmarkGuardCheck(b *testing.B) {
	g := dialguard.New(nil)
	ip := netip.MustParseAddr("10.1.2.3")
	for b.Loop() {
		if err := g.Check(ip); err != nil {
			b.Fatal(err)
		}
	}
}

// The swarm reads an origin with many ranged GETs at once, one after the
// other on each flow with a moment between (the next chunk is picked when
// one ends): the transport keeps their connections for the next, rather
// than closing all but two and dialling anew (a TCP handshake and slow
// start per chunk, on a link the fill keeps full).
func TestTransportKeepsParallelConnections(t *testing.T) {
	t.Parallel()
	var dialled atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write(make([]byte, 64<<10))
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			dialled.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	c := &http.Client{Transport: dialguard.New(nil, srv.Listener.Addr().String()).Transport()}
	const flows, requests = 16, 10
	var wg sync.WaitGroup
	for range flows {
		wg.Go(func() {
			for range requests {
				resp, err := c.Get(srv.URL)
				if !assert.NoError(t, err) {
					return
				}
				_, err = io.Copy(io.Discard, resp.Body)
				assert.NoError(t, err)
				resp.Body.Close()
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	require.LessOrEqual(t, dialled.Load(), int64(2*flows), "%d requests on %d flows", flows*requests, flows)
}
