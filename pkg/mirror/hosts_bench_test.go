package mirror

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
)

// BenchmarkPullDeadAgent measures what a dead agent costs a CRI pull by
// containerd 2.4.2 through the hosts.toml weightd writes: alternating in
// each iteration, a pull with no mirror (the node's own hosts.toml, server
// only: the baseline), one with weightd's mirror merged in front and
// nothing listening at its address (connection refused), and one with its
// address blackholed (SYNs dropped: a listener whose accept queue is full,
// so each request waits for the mirror's dial_timeout). Each pull starts
// from an empty content store. It reports each mode's mean milliseconds per
// pull and the dead modes' ratios to the baseline:
//
//	go test -run '^$' -bench BenchmarkPullDeadAgent -benchtime 5x ./pkg/mirror/
func BenchmarkPullDeadAgent(b *testing.B) {
	bins := services.RequireContainerd2(b)
	reg := services.NewRegistryT(b, services.RegistryConfig{})
	ctx := context.Background()
	const layers = 4
	img, err := services.PushRandomImage(ctx, reg.Addr, "bench/dead-agent", "v1", layers, 1<<20, nil)
	require.NoError(b, err)
	const registry = "registry.invalid"
	ref := strings.Replace(img.Ref, reg.Addr, registry, 1)
	ctd := services.NewContainerdT(b, services.ContainerdConfig{Binaries: bins})
	dir := filepath.Join(ctd.HostsDir, registry)
	require.NoError(b, os.MkdirAll(dir, 0o755))
	nodeHosts := []byte("server = \"http://" + reg.Addr + "\"\n")

	refused, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	refusedURL := "http://" + refused.Addr().String()
	require.NoError(b, refused.Close())
	blackholedURL := blackholedAddr(b)

	modes := []struct {
		name   string
		mirror string // "" for none
		total  time.Duration
	}{{name: "none"}, {name: "refused", mirror: refusedURL}, {name: "blackholed", mirror: blackholedURL}}
	pull := func(mirrorURL string) time.Duration {
		require.NoError(b, RestoreHosts(ctd.HostsDir, []string{registry}))
		require.NoError(b, os.WriteFile(filepath.Join(dir, "hosts.toml"), nodeHosts, 0o644))
		if mirrorURL != "" {
			require.NoError(b, ConfigureHosts(ctd.HostsDir, mirrorURL, []string{registry}))
		}
		require.NoError(b, ctd.RemoveImages(ctx))
		start := time.Now()
		_, err := ctd.PullImageCRI(ctx, ref)
		took := time.Since(start)
		require.NoError(b, err, "%s", ctd.LogTail())
		return took
	}
	pull("") // warm the daemon and the registry
	b.ResetTimer()
	for b.Loop() {
		for i := range modes {
			modes[i].total += pull(modes[i].mirror)
		}
	}
	b.StopTimer()
	perPull := func(d time.Duration) float64 { return float64(d.Milliseconds()) / float64(b.N) }
	for _, m := range modes {
		b.ReportMetric(perPull(m.total), m.name+"-ms/pull")
	}
	b.ReportMetric(float64(modes[1].total)/float64(modes[0].total), "refused/none")
	b.ReportMetric(float64(modes[2].total)/float64(modes[0].total), "blackholed/none")
	b.ReportMetric(0, "ns/op")
}

// blackholedAddr is a loopback URL whose SYNs are dropped: a listener with
// a backlog of 0 whose one queued connection is held and never accepted.
// It checks that a dial there does time out.
func blackholedAddr(b *testing.B) string {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	require.NoError(b, err)
	b.Cleanup(func() { syscall.Close(fd) })
	require.NoError(b, syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
	require.NoError(b, syscall.Listen(fd, 0))
	sa, err := syscall.Getsockname(fd)
	require.NoError(b, err)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
	for range 8 {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return "http://" + addr
		}
		require.NoError(b, err)
		b.Cleanup(func() { c.Close() })
	}
	b.Fatalf("%s still accepts connections: not blackholed", addr)
	return ""
}
