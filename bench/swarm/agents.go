package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	cmd    *exec.Cmd
	client *api.Client
	exited chan struct{} // closed once the process has exited
	err    error         // how it exited, once exited is closed
}

// agentSet is the agents of one mode.
type agentSet struct {
	agents []*agent
	stop   context.CancelFunc // stops them all: SIGTERM, SIGKILL after 15 s
}

// startAgents starts one agent in each host, its cache and socket under dir,
// and waits (30 s at most) until each one's API answers and lists every
// other as a peer. The first agent starts alone, so
// that the others find it listening when they join through it. The agents
// stop when ctx ends or on close.
func startAgents(ctx context.Context, hosts []*testbed.Host, bin, dir string, chunkMiB int, extra []string) (*agentSet, error) {
	actx, stop := context.WithCancel(ctx)
	set := &agentSet{stop: stop}
	join := netip.AddrPortFrom(hosts[0].Addr, gossipPort).String()
	start := func(h *testbed.Host) (*agent, error) {
		sock := "unix://" + filepath.Join(dir, h.Name+".sock")
		args := []string{
			"agent",
			"--root", filepath.Join(dir, h.Name),
			"--api", sock,
			"--metrics-addr", netip.AddrPortFrom(h.Addr, metricsPort).String(),
			"--log-level", "warn",
			"--chunk-size", fmt.Sprintf("%dMiB", chunkMiB),
			"--gossip-addr", netip.AddrPortFrom(h.Addr, gossipPort).String(),
			"--join", join,
			"--chunk-addr", netip.AddrPortFrom(h.Addr, chunkPort).String(),
			// The hosts share the machine's hostname, the default node name.
			"--node-name", h.Name,
		}
		args = append(args, extra...)
		client, err := api.NewClient(sock)
		if err != nil {
			return nil, err
		}
		cmd := h.Command(actx, bin, args...)
		cmd.Stdout = &lineWriter{prefix: h.Name + ": ", w: os.Stderr}
		cmd.Stderr = cmd.Stdout
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 15 * time.Second
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("starting the agent in %s: %w", h.Name, err)
		}
		a := &agent{host: h, cmd: cmd, client: client, exited: make(chan struct{})}
		go func() {
			a.err = cmd.Wait()
			close(a.exited)
		}()
		set.agents = append(set.agents, a)
		return a, nil
	}
	// each runs f on every agent at once and joins the errors.
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
		seed, err := start(hosts[0])
		if err != nil {
			return err
		}
		if err := seed.waitReady(ctx, wait); err != nil {
			return err
		}
		for _, h := range hosts[1:] {
			if _, err := start(h); err != nil {
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
			return fmt.Errorf("agent in %s exited before it was ready: %v", a.host.Name, a.err)
		default:
			return fmt.Errorf("agent in %s not ready after %v: %w", a.host.Name, timeout, err)
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
			return fmt.Errorf("agent in %s: %w", a.host.Name, err)
		}
		seen := 0
		for _, p := range st.Peers {
			if p.Name != a.host.Name {
				seen++
			}
		}
		if seen >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent in %s lists %d peers after %v, want %d", a.host.Name, seen, timeout, n)
		}
		select {
		case <-a.exited:
			return fmt.Errorf("agent in %s exited while joining: %v", a.host.Name, a.err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// cpu returns the CPU time (user and system) the agent has used so far,
// from fields 14 and 15 of /proc/<pid>/stat, in USER_HZ ticks (100 per
// second on Linux).
func (a *agent) cpu() (time.Duration, error) {
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

// machineBusy returns the CPU time the whole machine has spent busy (all
// but idle and iowait), over all cores, from /proc/stat.
func machineBusy() (time.Duration, error) {
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

// kill sends the agent SIGKILL, as a node that dies.
func (a *agent) kill() error { return a.cmd.Process.Kill() }

// close stops every agent (SIGTERM, then SIGKILL after 15 s) and waits until
// they have exited.
func (s *agentSet) close() {
	s.stop()
	for _, a := range s.agents {
		<-a.exited
	}
}

// fetch asks a to fetch ref and waits until the job ends, calling onStatus
// with each status. It returns how long the job took from the request, or
// an error if it did not end ready.
func (a *agent) fetch(ctx context.Context, ref string, onStatus func(prefetch.JobStatus)) (time.Duration, error) {
	start := time.Now()
	st, err := a.client.Fetch(ctx, ref)
	if err != nil {
		return 0, fmt.Errorf("%s: submitting: %w", a.host.Name, err)
	}
	final, err := a.client.Watch(ctx, st.ID, onStatus)
	took := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("%s: watching job %s: %w", a.host.Name, st.ID, err)
	}
	if final.State != prefetch.StateReady {
		return 0, fmt.Errorf("%s: job %s ended %s: %s", a.host.Name, st.ID, final.State, final.Error)
	}
	return took, nil
}

// fetchAll asks agent i to fetch ref delays[i] after a common start, and
// returns how long each took from its own request. If victim is an agent's
// index, that agent is killed (SIGKILL) once it holds half bytes: its
// failure is then expected and its time left zero; it is an error if it
// finishes before. The first other failure cancels the rest and is returned.
func fetchAll(ctx context.Context, agents []*agent, ref string, delays []time.Duration, victim int, half int64) ([]time.Duration, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	took := make([]time.Duration, len(agents))
	var (
		wg     sync.WaitGroup
		killed atomic.Bool
		start  = make(chan struct{})
	)
	for i, a := range agents {
		wg.Go(func() {
			<-start
			select {
			case <-time.After(delays[i]):
			case <-ctx.Done():
				return
			}
			var onStatus func(prefetch.JobStatus)
			if i == victim {
				onStatus = func(st prefetch.JobStatus) {
					if !st.State.Finished() && st.BytesDone >= half && killed.CompareAndSwap(false, true) {
						log.Printf("killing the agent in %s (SIGKILL) at %d of %d bytes", a.host.Name, st.BytesDone, st.BytesTotal)
						if err := a.kill(); err != nil {
							cancel(fmt.Errorf("killing the agent in %s: %w", a.host.Name, err))
						}
					}
				}
			}
			d, err := a.fetch(ctx, ref, onStatus)
			switch {
			case i == victim && killed.Load(): // it died, as planned
			case i == victim && err == nil:
				cancel(fmt.Errorf("%s finished before it held half the blob: nothing to kill", a.host.Name))
			case err != nil:
				cancel(err)
			default:
				took[i] = d
			}
		})
	}
	close(start)
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	return took, nil
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
