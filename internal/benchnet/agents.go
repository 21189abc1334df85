// Package benchnet runs weightd agents, an HTTP origin and an OCI registry
// in the hosts of a testbed (internal/testbed), for the benchmarks that
// measure them over shaped links: bench/swarm, bench/podready and
// bench/mirrorswarm.
//
// The origin and the registry run inside their host as the benchmark's own
// executable: a benchmark that calls StartOrigin must, when run with
// "-serve-origin DIR -listen ADDR -control SOCKET", call ServeOrigin, and
// one that calls StartRegistry must, when run with
// "-serve-registry DIR -listen ADDR -control SOCKET", call ServeRegistry.
package benchnet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/pkg/prefetch"
)

// Ports of an agent on its host's address.
const (
	MetricsPort = 9464
	GossipPort  = 7946
	ChunkPort   = 7947
	// MirrorPort is where an agent's registry mirror listens, when its
	// flags turn it on (--mirror-addr).
	MirrorPort = 5001
)

// Agent is one weightd agent running in a host of the testbed.
type Agent struct {
	Host *testbed.Host
	// Node is its name in the swarm (and its Kubernetes node name).
	Node   string
	Client *api.Client

	cmd    *exec.Cmd
	stop   context.CancelFunc // SIGTERM, SIGKILL after 15 s
	exited chan struct{}      // closed once the process has exited
	err    error              // how it exited, once exited is closed
}

// AgentConfig says how to run the agents.
type AgentConfig struct {
	// Bin is the weightd binary; each agent's cache and API socket go
	// under Dir.
	Bin, Dir string
	// ChunkMiB is the agents' chunk size.
	ChunkMiB int
	// Nodes names the agents, one per host; empty: the hosts' names (the
	// hosts share the machine's hostname, the default node name).
	Nodes []string
	// Kubeconfig, when set, has the agents watch their Node's pods.
	Kubeconfig string
	// Extra are more flags for every agent.
	Extra []string
	// PlainPeers has the agents share over plain HTTP (--peer-insecure);
	// otherwise they talk mutual TLS with a CA written to Dir, as the
	// chart sets them up.
	PlainPeers bool
	// HostExtra, when set, returns more flags for the agent in host h,
	// after Extra (those that name the host's address or its own files).
	HostExtra func(h *testbed.Host) []string
}

// Agents is a set of running agents, in the order they started.
type Agents struct {
	List []*Agent
}

// StartAgents starts an agent in each host and waits (30 s at most) until
// each one's API answers and lists every other as a peer. The first agent
// starts alone, so that the others find it listening when they join through
// it. The agents stop when ctx ends or on Close.
func StartAgents(ctx context.Context, hosts []*testbed.Host, cfg AgentConfig) (*Agents, error) {
	nodes := cfg.Nodes
	if len(nodes) == 0 {
		for _, h := range hosts {
			nodes = append(nodes, h.Name)
		}
	}
	if len(nodes) != len(hosts) {
		return nil, fmt.Errorf("%d node names for %d hosts", len(nodes), len(hosts))
	}
	bin, dir := cfg.Bin, cfg.Dir
	set := &Agents{}
	join := netip.AddrPortFrom(hosts[0].Addr, GossipPort).String()
	peerArgs := []string{"--peer-insecure"}
	if !cfg.PlainPeers {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		ca, err := peertls.WriteCA(dir, "weightd bench CA")
		if err != nil {
			return nil, err
		}
		peerArgs = []string{"--peer-ca-file", ca.CA, "--peer-ca-key-file", ca.Key}
	}
	start := func(h *testbed.Host, node string) (*Agent, error) {
		sock := "unix://" + filepath.Join(dir, node+".sock")
		args := []string{
			"agent",
			"--root", filepath.Join(dir, node),
			"--api", sock,
			"--metrics-addr", netip.AddrPortFrom(h.Addr, MetricsPort).String(),
			"--log-level", "warn",
			"--chunk-size", fmt.Sprintf("%dMiB", cfg.ChunkMiB),
			"--gossip-addr", netip.AddrPortFrom(h.Addr, GossipPort).String(),
			"--join", join,
			"--chunk-addr", netip.AddrPortFrom(h.Addr, ChunkPort).String(),
			"--node-name", node,
			// Every agent of the testbed shares one kernel: eight load
			// tracers would each run on every syscall of the machine,
			// where a node has one.
			"--no-load-trace",
		}
		args = append(args, peerArgs...)
		if cfg.Kubeconfig != "" {
			args = append(args, "--kubeconfig", cfg.Kubeconfig)
		}
		args = append(args, cfg.Extra...)
		if cfg.HostExtra != nil {
			args = append(args, cfg.HostExtra(h)...)
		}
		client, err := api.NewClient(sock)
		if err != nil {
			return nil, err
		}
		actx, stop := context.WithCancel(ctx)
		cmd := h.Command(actx, bin, args...)
		// In a process group of its own: a Ctrl-C in the terminal reaches
		// only the bench, which stops the agents in order.
		cmd.SysProcAttr.Setpgid = true
		cmd.Stdout = &LineWriter{Prefix: node + ": ", W: os.Stderr}
		cmd.Stderr = cmd.Stdout
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 15 * time.Second
		if err := cmd.Start(); err != nil {
			stop()
			return nil, fmt.Errorf("starting the agent in %s: %w", h.Name, err)
		}
		a := &Agent{Host: h, Node: node, cmd: cmd, Client: client, stop: stop, exited: make(chan struct{})}
		go func() {
			a.err = cmd.Wait()
			close(a.exited)
		}()
		set.List = append(set.List, a)
		return a, nil
	}
	each := func(f func(*Agent) error) error {
		errs := make([]error, len(set.List))
		var wg sync.WaitGroup
		for i, a := range set.List {
			wg.Go(func() { errs[i] = f(a) })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	const wait = 30 * time.Second
	// Memberlist (LAN defaults) pushes and pulls its member list every
	// 30 s; an agent that missed a newcomer's gossip (a starved process
	// drops UDP) learns of it at the next round, so wait for a few rounds.
	const peersWait = 90 * time.Second
	err := func() error {
		seed, err := start(hosts[0], nodes[0])
		if err != nil {
			return err
		}
		if err := seed.waitReady(ctx, wait); err != nil {
			return err
		}
		for i, h := range hosts[1:] {
			if _, err := start(h, nodes[i+1]); err != nil {
				return err
			}
		}
		if err := each(func(a *Agent) error { return a.waitReady(ctx, wait) }); err != nil {
			return err
		}
		return each(func(a *Agent) error { return a.waitPeers(ctx, len(hosts)-1, peersWait) })
	}()
	if err != nil {
		set.Close()
		return nil, err
	}
	return set, nil
}

// waitReady polls the agent's API until it answers, the agent exits or
// timeout passes.
func (a *Agent) waitReady(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	go func() {
		select {
		case <-a.exited:
			cancel()
		case <-ctx.Done():
		}
	}()
	if err := a.Client.WaitReady(ctx); err != nil {
		select {
		case <-a.exited:
			return fmt.Errorf("agent %s exited before it was ready: %v", a.Node, a.err)
		default:
			return fmt.Errorf("agent %s not ready after %v: %w", a.Node, timeout, err)
		}
	}
	return nil
}

// waitPeers polls the agent's status until it lists n peers other than
// itself, the agent exits or timeout passes.
func (a *Agent) waitPeers(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		st, err := a.Client.Status(ctx)
		if err != nil {
			return fmt.Errorf("agent %s: %w", a.Node, err)
		}
		seen := 0
		for _, p := range st.Peers {
			if p.Name != a.Node {
				seen++
			}
		}
		if seen >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent %s lists %d peers after %v, want %d", a.Node, seen, timeout, n)
		}
		select {
		case <-a.exited:
			return fmt.Errorf("agent %s exited while joining: %v", a.Node, a.err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Close stops the agents one after the other, the last started first
// (SIGTERM, then SIGKILL after 15 s), so that each leaves the swarm while
// the others still listen.
func (s *Agents) Close() {
	for i := len(s.List) - 1; i >= 0; i-- {
		s.List[i].stop()
		<-s.List[i].exited
	}
}

// Fetch asks a to fetch ref and waits until the job ends, calling onStatus
// with each status. It returns how long the job took from the request, or
// an error if it did not end ready.
func (a *Agent) Fetch(ctx context.Context, ref string, onStatus func(prefetch.JobStatus)) (time.Duration, error) {
	start := time.Now()
	st, err := a.Client.Fetch(ctx, ref)
	if err != nil {
		return 0, fmt.Errorf("%s: submitting: %w", a.Node, err)
	}
	final, err := a.Client.Watch(ctx, st.ID, onStatus)
	took := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("%s: watching job %s: %w", a.Node, st.ID, err)
	}
	if final.State != prefetch.StateReady {
		return 0, fmt.Errorf("%s: job %s ended %s: %s", a.Node, st.ID, final.State, final.Error)
	}
	return took, nil
}

// CPU returns the CPU time (user and system) the agent has used so far,
// from fields 14 and 15 of /proc/<pid>/stat, in USER_HZ ticks (100 per
// second on Linux).
func (a *Agent) CPU() (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", a.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')') // the command name may hold spaces
	f := strings.Fields(string(b[i+1:]))
	if i < 0 || len(f) < 13 {
		return 0, fmt.Errorf("parsing /proc/%d/stat", a.cmd.Process.Pid)
	}
	var ticks int64
	for _, x := range f[11:13] { // fields 14 and 15; f[0] is field 3
		n, err := strconv.ParseInt(x, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("parsing /proc/%d/stat: %w", a.cmd.Process.Pid, err)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / 100, nil
}

// MachineBusy returns the CPU time the whole machine has spent busy (all
// but idle and iowait), over all cores, from /proc/stat.
func MachineBusy() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0, errors.New("parsing /proc/stat")
	}
	var ticks int64
	for i, x := range f[1:] {
		n, err := strconv.ParseInt(x, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("parsing /proc/stat: %w", err)
		}
		if i != 3 && i != 4 && i < 8 { // not idle or iowait, nor guest (counted in user)
			ticks += n
		}
	}
	return time.Duration(ticks) * time.Second / 100, nil
}

// CPUSample is the CPU time used so far by the machine and by each agent.
type CPUSample struct {
	at      time.Time
	machine time.Duration
	agents  []time.Duration
}

// SampleCPU reads the machine's and every agent's CPU time, but agent
// skip's (-1: none; a killed agent cannot be read).
func SampleCPU(agents []*Agent, skip int) (CPUSample, error) {
	s := CPUSample{at: time.Now(), agents: make([]time.Duration, len(agents))}
	var err error
	if s.machine, err = MachineBusy(); err != nil {
		return s, err
	}
	for i, a := range agents {
		if i == skip {
			continue
		}
		if s.agents[i], err = a.CPU(); err != nil {
			return s, fmt.Errorf("reading the CPU time of the agent in %s: %w", a.Node, err)
		}
	}
	return s, nil
}

// Since is the wall time from s0 to s.
func (s CPUSample) Since(s0 CPUSample) time.Duration { return s.at.Sub(s0.at) }

// Busy is the share of the machine's CPUs busy from s0 to s, 0–1: near 1,
// the CPUs rather than the links may have set the times.
func (s CPUSample) Busy(s0 CPUSample) float64 {
	return (s.machine - s0.machine).Seconds() / s.Since(s0).Seconds() / float64(runtime.NumCPU())
}

// AgentSeconds is the CPU time the agents but skip used from s0 to s.
func (s CPUSample) AgentSeconds(s0 CPUSample, skip int) float64 {
	var agents time.Duration
	for i := range s.agents {
		if i != skip {
			agents += s.agents[i] - s0.agents[i]
		}
	}
	return agents.Seconds()
}

// Kill sends the agent SIGKILL, as a node that dies.
func (a *Agent) Kill() error { return a.cmd.Process.Kill() }

// LineWriter writes whole lines to w, each after prefix, so that the logs
// of several processes interleave line by line. Set Prefix and W.
type LineWriter struct {
	Prefix string
	W      io.Writer

	mu  sync.Mutex
	buf []byte
}

func (l *LineWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 && len(l.buf) >= 64<<10 { // a runaway line: pass it on in pieces
			i = len(l.buf) - 1
		}
		if i < 0 {
			break
		}
		line := append([]byte(l.Prefix), l.buf[:i+1]...)
		if _, err := l.W.Write(line); err != nil {
			return len(p), err
		}
		l.buf = l.buf[i+1:]
	}
	return len(p), nil
}
