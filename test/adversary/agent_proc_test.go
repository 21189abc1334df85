package adversary

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
)

// agentProc is `weightd agent` running as a process.
type agentProc struct {
	cmd    *exec.Cmd
	logs   *lockedBuffer
	exited chan struct{}
	client *api.Client
}

// startAgentProc runs `weightd agent` with a cache and a unix API socket in
// a new directory, no gossip and no metrics, then args; in host's network
// namespace unless host is nil; with env added to this process's
// environment. It does not wait for the agent to be ready.
func startAgentProc(t *testing.T, host *testbed.Host, env []string, args ...string) *agentProc {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "api.sock")
	all := append([]string{"agent", "--root", filepath.Join(dir, "cache"), "--api", "unix://" + sock,
		"--metrics-addr=", "--gossip-addr=", "--log-level", "info"}, args...)
	bin := weightdBinary(t)
	a := &agentProc{logs: &lockedBuffer{}, exited: make(chan struct{})}
	if host != nil {
		a.cmd = host.Command(context.Background(), bin, all...)
	} else {
		a.cmd = exec.Command(bin, all...)
		a.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	}
	a.cmd.Env = append(os.Environ(), env...)
	a.cmd.Stdout, a.cmd.Stderr = a.logs, a.logs
	require.NoError(t, a.cmd.Start())
	go func() { a.cmd.Wait(); close(a.exited) }()
	t.Cleanup(func() {
		a.cmd.Process.Signal(syscall.SIGKILL)
		<-a.exited
		if t.Failed() {
			t.Logf("agent log:\n%s", a.logs.String())
		}
	})
	var err error
	a.client, err = api.NewClient("unix://" + sock)
	require.NoError(t, err)
	return a
}

// waitReady waits until the agent answers its readiness check.
func (a *agentProc) waitReady(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	require.NoError(t, a.client.WaitReady(ctx), "agent log:\n%s", a.logs.String())
}

// fetch submits ref and waits for its job to end.
func (a *agentProc) fetch(t *testing.T, ref string) prefetch.JobStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	st, err := a.client.Fetch(ctx, ref)
	require.NoError(t, err)
	st, err = a.client.Watch(ctx, st.ID, func(prefetch.JobStatus) {})
	require.NoError(t, err)
	return st
}

// exitLog waits for an agent expected to refuse its configuration and
// returns its log; it fails the test if the agent is still running after
// 30 s (it started, so it accepted the configuration).
func (a *agentProc) exitLog(t *testing.T) string {
	t.Helper()
	select {
	case <-a.exited:
		return a.logs.String()
	case <-time.After(30 * time.Second):
		t.Fatalf("the agent accepted its configuration and runs; log:\n%s", a.logs.String())
		return ""
	}
}

// hasLine reports whether log has a line containing every one of words.
func hasLine(log string, words ...string) bool {
	for line := range strings.Lines(log) {
		all := true
		for _, w := range words {
			all = all && strings.Contains(line, w)
		}
		if all {
			return true
		}
	}
	return false
}
