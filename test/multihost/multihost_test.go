// Package multihost tests weightd agents as separate processes on separate
// hosts: one network namespace per host on a shaped bridge (internal/testbed),
// an origin in its own namespace, the real weightd binary, gossip and chunks
// over the namespaces' network. It needs root; under CI=true a machine that
// cannot host the testbed fails the tests instead of skipping them.
package multihost

import (
	"context"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/pkg/prefetch"
)

const (
	blobSize   = 24 << 20
	linkMbit   = 200
	originPort = 8080
)

// weightdBin is the agent binary, built once by TestMain.
var weightdBin string

func TestMain(m *testing.M) {
	if os.Getenv("WEIGHTD_ORIGIN_DIR") != "" {
		os.Exit(runOrigin())
	}
	dir, err := os.MkdirTemp("", "weightd-multihost-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	weightdBin = filepath.Join(dir, "weightd")
	if out, err := exec.Command("go", "build", "-o", weightdBin, "github.com/weightd/weightd/cmd/weightd").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building weightd: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// runOrigin is the origin process, run inside the origin host's namespace:
// it serves WEIGHTD_ORIGIN_DIR on WEIGHTD_ORIGIN_LISTEN and answers "how many
// bytes have you served" on the unix socket WEIGHTD_ORIGIN_CONTROL, which the
// test reaches through the shared filesystem.
func runOrigin() int {
	ln, err := net.Listen("tcp", os.Getenv("WEIGHTD_ORIGIN_LISTEN"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	srv := genmodel.NewServer(ln, os.Getenv("WEIGHTD_ORIGIN_DIR"))
	ctl, err := net.Listen("unix", os.Getenv("WEIGHTD_ORIGIN_CONTROL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	go http.Serve(ctl, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, srv.BytesServed())
	}))
	if err := srv.Run(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// cluster is a testbed with an origin on host 0 and agents on the others.
type cluster struct {
	t       *testing.T
	tb      *testbed.Testbed
	dir     string
	ref     string
	control string
	hosts   []*testbed.Host
	keyFile string
	ca      peertls.Files // the cluster CA the agents talk mutual TLS with
}

type agentProc struct {
	host   *testbed.Host
	cmd    *exec.Cmd
	client *api.Client
	logs   *lockedBuffer
	exited chan struct{}
}

func newCluster(t *testing.T, agents int) *cluster {
	tb := testbed.NewT(t, testbed.Config{Hosts: agents + 1, LinkMbit: linkMbit})
	dir := testdisk.ShortDir(t)
	c := &cluster{t: t, tb: tb, dir: dir, hosts: tb.Hosts(), control: filepath.Join(dir, "origin.sock")}
	m, err := genmodel.Generate(filepath.Join(dir, "origin"), genmodel.Spec{Name: "test/blob", Files: 1, TotalBytes: blobSize, Seed: 7})
	require.NoError(t, err)
	originHost := c.hosts[0]
	cmd := originHost.Command(t.Context(), os.Args[0])
	cmd.Env = append(os.Environ(), "WEIGHTD_ORIGIN_DIR="+filepath.Join(dir, "origin"),
		"WEIGHTD_ORIGIN_LISTEN="+net.JoinHostPort(originHost.Addr.String(), strconv.Itoa(originPort)),
		"WEIGHTD_ORIGIN_CONTROL="+c.control)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	require.Eventually(t, func() bool { _, err := c.originServed(); return err == nil }, 10*time.Second, 20*time.Millisecond)
	c.ref = fmt.Sprintf("http://%s/%s#sha256:%s", net.JoinHostPort(originHost.Addr.String(), strconv.Itoa(originPort)), m.Files[0].Path, m.Files[0].SHA256)
	c.keyFile = c.writeKey("key-a", 1)
	c.ca, err = peertls.WriteCA(dir, "multihost CA")
	require.NoError(t, err)
	return c
}

func (c *cluster) writeKey(name string, b byte) string {
	key := make([]byte, 32)
	for i := range key {
		key[i] = b
	}
	path := filepath.Join(c.dir, name)
	require.NoError(c.t, os.WriteFile(path, []byte(base64.StdEncoding.EncodeToString(key)+"\n"), 0o600))
	return path
}

// originServed asks the origin process how many bytes it has sent.
func (c *cluster) originServed() (int64, error) {
	client := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", c.control)
	}}, Timeout: 5 * time.Second}
	resp, err := client.Get("http://origin/served")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var n int64
	_, err = fmt.Fscan(resp.Body, &n)
	return n, err
}

// start runs the agent on host i (1-based: host 0 is the origin), joining
// through host 1's agent unless it is host 1.
func (c *cluster) start(i int, keyFile string) *agentProc {
	h := c.hosts[i]
	addr := h.Addr.String()
	sock := filepath.Join(c.dir, h.Name+".sock")
	args := []string{"agent", "--root", filepath.Join(c.dir, h.Name), "--api", "unix://" + sock,
		"--metrics-addr", "", "--log-level", "info", "--chunk-size", "1MiB", "--fast-gossip",
		"--node-name", h.Name, "--gossip-addr", net.JoinHostPort(addr, "7946"),
		"--chunk-addr", net.JoinHostPort(addr, "7947"), "--gossip-key-file", keyFile,
		"--peer-ca-file", c.ca.CA, "--peer-ca-key-file", c.ca.Key}
	if i != 1 {
		args = append(args, "--join", net.JoinHostPort(c.hosts[1].Addr.String(), "7946"))
	}
	a := &agentProc{host: h, cmd: h.Command(context.Background(), weightdBin, args...), logs: &lockedBuffer{}, exited: make(chan struct{})}
	a.cmd.Stdout, a.cmd.Stderr = a.logs, a.logs
	require.NoError(c.t, a.cmd.Start())
	go func() { a.cmd.Wait(); close(a.exited) }()
	c.t.Cleanup(func() {
		a.kill()
		if c.t.Failed() {
			c.t.Logf("agent %s log:\n%s", h.Name, a.logs.String())
		}
	})
	var err error
	a.client, err = api.NewClient("unix://" + sock)
	require.NoError(c.t, err)
	ctx, cancel := context.WithTimeout(c.t.Context(), 20*time.Second)
	defer cancel()
	require.NoError(c.t, a.client.WaitReady(ctx), "agent %s: %s", h.Name, a.logs.String())
	return a
}

func (a *agentProc) kill() {
	a.cmd.Process.Signal(syscall.SIGKILL)
	<-a.exited
}

func (a *agentProc) peers(ctx context.Context) int {
	st, err := a.client.Status(ctx)
	if err != nil {
		return -1
	}
	return len(st.Peers)
}

// waitPeers waits until every agent sees n peers.
func (c *cluster) waitPeers(n int, agents ...*agentProc) {
	require.Eventually(c.t, func() bool {
		for _, a := range agents {
			if a.peers(c.t.Context()) != n {
				return false
			}
		}
		return true
	}, 20*time.Second, 50*time.Millisecond)
}

// fetch asks a to fetch the blob and waits for the end.
func (c *cluster) fetch(ctx context.Context, a *agentProc) error {
	st, err := a.client.Fetch(ctx, c.ref)
	if err != nil {
		return err
	}
	final, err := a.client.Watch(ctx, st.ID, func(prefetch.JobStatus) {})
	if err != nil {
		return fmt.Errorf("%s: %w", a.host.Name, err)
	}
	if final.State != prefetch.StateReady {
		return fmt.Errorf("%s: %s: %s", a.host.Name, final.State, final.Error)
	}
	return nil
}

func (c *cluster) fetchAll(agents ...*agentProc) error {
	ctx, cancel := context.WithTimeout(c.t.Context(), 90*time.Second)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	for _, a := range agents {
		g.Go(func() error { return c.fetch(ctx, a) })
	}
	return g.Wait()
}

func TestSimultaneousFetchServesOneOriginCopy(t *testing.T) {
	c := newCluster(t, 4)
	var agents []*agentProc
	for i := 1; i <= 4; i++ {
		agents = append(agents, c.start(i, c.keyFile))
	}
	c.waitPeers(3, agents...)
	require.NoError(t, c.fetchAll(agents...))
	served, err := c.originServed()
	require.NoError(t, err)
	ratio := float64(served) / blobSize
	t.Logf("origin served %.3f copies for 4 agents", ratio)
	require.LessOrEqual(t, ratio, 1.1, "the origin serves about one copy")
}

func TestPeerKilledMidTransfer(t *testing.T) {
	c := newCluster(t, 4)
	var agents []*agentProc
	for i := 1; i <= 4; i++ {
		agents = append(agents, c.start(i, c.keyFile))
	}
	c.waitPeers(3, agents...)
	for _, h := range c.hosts {
		require.NoError(t, c.tb.SetLink(h, 50)) // 24 MiB takes about 4 s
	}
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	g, gctx := errgroup.WithContext(ctx)
	for _, a := range agents[:3] {
		g.Go(func() error { return c.fetch(gctx, a) })
	}
	victim := agents[3]
	errVictim := make(chan error, 1)
	go func() { errVictim <- c.fetch(ctx, victim) }()
	require.Eventually(t, func() bool {
		st, err := victim.client.Status(ctx)
		return err == nil && len(st.Cache.InFlight) == 1 && st.Cache.InFlight[0].Done > 4<<20
	}, 30*time.Second, 20*time.Millisecond)
	victim.kill()
	require.Error(t, <-errVictim)
	require.NoError(t, g.Wait(), "the others complete without the killed peer")
}

func TestOriginUnreachableOnceOneCopyExists(t *testing.T) {
	c := newCluster(t, 3)
	var agents []*agentProc
	for i := 1; i <= 3; i++ {
		agents = append(agents, c.start(i, c.keyFile))
	}
	c.waitPeers(2, agents...)
	require.NoError(t, c.fetchAll(agents[0]))
	require.NoError(t, c.tb.Down(c.hosts[0]))
	defer c.tb.Up(c.hosts[0])
	// The others learn from gossip that a complete copy exists; the origin
	// answers nothing now (its link is down), yet they complete.
	time.Sleep(500 * time.Millisecond)
	require.NoError(t, c.fetchAll(agents[1:]...))
}

func TestLateJoinerFetchesFromPeers(t *testing.T) {
	c := newCluster(t, 3)
	first := []*agentProc{c.start(1, c.keyFile), c.start(2, c.keyFile)}
	c.waitPeers(1, first...)
	require.NoError(t, c.fetchAll(first...))
	require.NoError(t, c.tb.Down(c.hosts[0]))
	defer c.tb.Up(c.hosts[0])

	late := c.start(3, c.keyFile)
	c.waitPeers(2, append(first, late)...)
	// The late node learns the holdings through push/pull, not broadcasts.
	require.NoError(t, c.fetchAll(late))
}

func TestNodeWithoutTheGossipKeyCannotJoin(t *testing.T) {
	c := newCluster(t, 3)
	a, b := c.start(1, c.keyFile), c.start(2, c.keyFile)
	c.waitPeers(1, a, b)
	stranger := c.start(3, c.writeKey("key-b", 2))
	time.Sleep(3 * time.Second) // several fast gossip rounds
	require.Equal(t, 0, stranger.peers(t.Context()), "a node with another key sees no one")
	require.Equal(t, 1, a.peers(t.Context()), "and no one sees it")
	require.Equal(t, 1, b.peers(t.Context()))
	require.Contains(t, stranger.logs.String(), "join", "the stranger logs its failed joins")
}

type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
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
