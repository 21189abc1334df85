package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
)

// Ports of an agent on its host's address.
const (
	metricsPort = 9464
	gossipPort  = 7946
	chunkPort   = 7947
)

// agent is one weightd agent running in a host of the testbed.
type agent struct {
	host   *testbed.Host
	node   string // its Node's name, also its name in the swarm
	cmd    *exec.Cmd
	client *api.Client
	stop   context.CancelFunc // SIGTERM, SIGKILL after 15 s
	exited chan struct{}      // closed once the process has exited
	err    error              // how it exited, once exited is closed
}

// agentSet is the bench's agents.
type agentSet struct {
	agents []*agent
}

// startAgents starts an agent in each host, named by nodes, its cache and
// socket under dir, watching its Node's pods through kubeconfig, and waits
// (30 s at most) until each one's API answers and lists every other as a
// peer. The first agent starts alone, so that the others find it listening
// when they join through it. The agents stop when ctx ends or on close.
func startAgents(ctx context.Context, hosts []*testbed.Host, nodes []string, bin, dir, kubeconfig string, chunkMiB int, extra []string) (*agentSet, error) {
	set := &agentSet{}
	join := netip.AddrPortFrom(hosts[0].Addr, gossipPort).String()
	start := func(h *testbed.Host, node string) (*agent, error) {
		sock := "unix://" + filepath.Join(dir, node+".sock")
		args := []string{
			"agent",
			"--root", filepath.Join(dir, node),
			"--api", sock,
			"--metrics-addr", netip.AddrPortFrom(h.Addr, metricsPort).String(),
			"--log-level", "warn",
			"--chunk-size", fmt.Sprintf("%dMiB", chunkMiB),
			"--gossip-addr", netip.AddrPortFrom(h.Addr, gossipPort).String(),
			"--join", join,
			"--chunk-addr", netip.AddrPortFrom(h.Addr, chunkPort).String(),
			"--node-name", node,
			"--kubeconfig", kubeconfig,
		}
		args = append(args, extra...)
		client, err := api.NewClient(sock)
		if err != nil {
			return nil, err
		}
		actx, stop := context.WithCancel(ctx)
		cmd := h.Command(actx, bin, args...)
		// In a process group of its own: a Ctrl-C in the terminal reaches
		// only the bench, which stops the agents in order.
		cmd.SysProcAttr.Setpgid = true
		cmd.Stdout = &lineWriter{prefix: node + ": ", w: os.Stderr}
		cmd.Stderr = cmd.Stdout
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 15 * time.Second
		if err := cmd.Start(); err != nil {
			stop()
			return nil, fmt.Errorf("starting the agent in %s: %w", h.Name, err)
		}
		a := &agent{host: h, node: node, cmd: cmd, client: client, stop: stop, exited: make(chan struct{})}
		go func() {
			a.err = cmd.Wait()
			close(a.exited)
		}()
		set.agents = append(set.agents, a)
		return a, nil
	}
	each := func(f func(*agent) error) error {
		errs := make([]error, len(set.agents))
		var wg sync.WaitGroup
		for i, a := range set.agents {
			wg.Go(func() { errs[i] = f(a) })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	const wait = 30 * time.Second
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
		if err := each(func(a *agent) error { return a.waitReady(ctx, wait) }); err != nil {
			return err
		}
		return each(func(a *agent) error { return a.waitPeers(ctx, len(hosts)-1, wait) })
	}()
	if err != nil {
		set.close()
		return nil, err
	}
	return set, nil
}

// waitReady polls the agent's API until it answers, the agent exits or
// timeout passes.
func (a *agent) waitReady(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	go func() {
		select {
		case <-a.exited:
			cancel()
		case <-ctx.Done():
		}
	}()
	if err := a.client.WaitReady(ctx); err != nil {
		select {
		case <-a.exited:
			return fmt.Errorf("agent %s exited before it was ready: %v", a.node, a.err)
		default:
			return fmt.Errorf("agent %s not ready after %v: %w", a.node, timeout, err)
		}
	}
	return nil
}

// waitPeers polls the agent's status until it lists n peers other than
// itself, the agent exits or timeout passes.
func (a *agent) waitPeers(ctx context.Context, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		st, err := a.client.Status(ctx)
		if err != nil {
			return fmt.Errorf("agent %s: %w", a.node, err)
		}
		seen := 0
		for _, p := range st.Peers {
			if p.Name != a.node {
				seen++
			}
		}
		if seen >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent %s lists %d peers after %v, want %d", a.node, seen, timeout, n)
		}
		select {
		case <-a.exited:
			return fmt.Errorf("agent %s exited while joining: %v", a.node, a.err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// close stops the agents one after the other, the last started first
// (SIGTERM, then SIGKILL after 15 s), so that each leaves the swarm while
// the others still listen.
func (s *agentSet) close() {
	for i := len(s.agents) - 1; i >= 0; i-- {
		s.agents[i].stop()
		<-s.agents[i].exited
	}
}

// fetch asks a to fetch ref and waits until the job ends, calling onStatus
// with each status. It returns how long the job took from the request, or
// an error if it did not end ready.
func (a *agent) fetch(ctx context.Context, ref string, onStatus func(prefetch.JobStatus)) (time.Duration, error) {
	start := time.Now()
	st, err := a.client.Fetch(ctx, ref)
	if err != nil {
		return 0, fmt.Errorf("%s: submitting: %w", a.node, err)
	}
	final, err := a.client.Watch(ctx, st.ID, onStatus)
	took := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("%s: watching job %s: %w", a.node, st.ID, err)
	}
	if final.State != prefetch.StateReady {
		return 0, fmt.Errorf("%s: job %s ended %s: %s", a.node, st.ID, final.State, final.Error)
	}
	return took, nil
}

// scrapeMetrics returns the agent's /metrics, read from inside its host (its
// metrics server listens on the host's address, which only the testbed's
// namespaces reach): the bench re-executes itself there with -scrape.
func scrapeMetrics(ctx context.Context, a *agent) (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	url := "http://" + netip.AddrPortFrom(a.host.Addr, metricsPort).String() + "/metrics"
	cmd := a.host.Command(ctx, exe, "-scrape", url)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("reading %s's metrics: %w: %s", a.node, err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// sumMetric adds the samples of metric in the Prometheus text exposition
// whose labels contain label (e.g. `source="peer"`).
func sumMetric(text, metric, label string) int64 {
	var sum float64
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, metric+"{")
		if !ok {
			continue
		}
		labels, value, ok := strings.Cut(rest, "} ")
		if !ok || !strings.Contains(labels, label) {
			continue
		}
		f := strings.Fields(value)
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			sum += v
		}
	}
	return int64(sum)
}

// lineWriter writes whole lines to w, each after prefix, so that the logs
// of several processes interleave line by line.
type lineWriter struct {
	prefix string
	w      io.Writer

	mu  sync.Mutex
	buf []byte
}

func (l *lineWriter) Write(p []byte) (int, error) {
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
		line := append([]byte(l.prefix), l.buf[:i+1]...)
		if _, err := l.w.Write(line); err != nil {
			return len(p), err
		}
		l.buf = l.buf[i+1:]
	}
	return len(p), nil
}
