package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/weightd/weightd/pkg/mirror"
)

// TestRestoreHosts: what ConfigureHosts wrote is undone, the operator's own
// hosts.toml comes back, and a second run changes nothing.
func TestRestoreHosts(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	own := []byte("server = \"https://ghcr.io\"\n# the operator's\n")
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "ghcr.io"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ghcr.io", "hosts.toml"), own, 0o644))
	regs := []string{"docker.io", "ghcr.io", "127.0.0.1:5000"}
	require.NoError(t, mirror.ConfigureHosts(dir, "http://127.0.0.1:5001", regs))

	for i := range 2 {
		var out, errOut bytes.Buffer
		code := run(t.Context(), []string{"restore-hosts", "--hosts-dir", dir, "--registries", strings.Join(regs, ",")}, &out, &errOut)
		require.Equal(t, 0, code, "run %d: %s", i, errOut.String())
		assert.Contains(t, out.String(), "restored in "+dir)
		b, err := os.ReadFile(filepath.Join(dir, "ghcr.io", "hosts.toml"))
		require.NoError(t, err)
		assert.Equal(t, own, b, "run %d: the operator's hosts.toml is back", i)
		for _, r := range []string{"docker.io", "127.0.0.1:5000"} {
			_, err := os.Stat(filepath.Join(dir, r))
			assert.ErrorIs(t, err, os.ErrNotExist, "run %d: weightd's %s is gone", i, r)
		}
		_, err = os.Stat(filepath.Join(dir, "ghcr.io", "hosts.toml.weightd-backup"))
		assert.ErrorIs(t, err, os.ErrNotExist)
	}
}

// TestRestoreHostsConfig reads the agent's configuration file for what the
// flags leave out, in both of the forms the agent takes.
func TestRestoreHostsConfig(t *testing.T) {
	t.Parallel()
	for name, regs := range map[string]string{
		"string": "docker.io,registry.k8s.io",
		"list":   "[docker.io, registry.k8s.io]",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			hosts := filepath.Join(dir, "certs.d")
			require.NoError(t, mirror.ConfigureHosts(hosts, "http://127.0.0.1:5001", []string{"docker.io", "registry.k8s.io"}))
			cfg := filepath.Join(dir, "config.yaml")
			require.NoError(t, os.WriteFile(cfg, []byte("agent:\n  root: /x\n  hosts-dir: "+hosts+"\n  mirror-registries: "+regs+"\n"), 0o644))
			var out, errOut bytes.Buffer
			code := run(t.Context(), []string{"restore-hosts", "--config", cfg}, &out, &errOut)
			require.Equal(t, 0, code, errOut.String())
			entries, err := os.ReadDir(hosts)
			require.NoError(t, err)
			assert.Empty(t, entries, "every hosts.toml of weightd removed")
		})
	}
}

func TestRestoreHostsUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"restore-hosts"}, "no registries to restore"},
		{[]string{"restore-hosts", "--registries", "docker.io"}, "no --hosts-dir"},
		{[]string{"restore-hosts", "--hosts-dir", "/nonexistent", "--registries", "a/b"}, `registry "a/b" is not a host[:port]`},
		{[]string{"restore-hosts", "--wait-daemonset", "x", "--hold"}, "--wait-daemonset restores nothing"},
	} {
		var out, errOut bytes.Buffer
		code := run(t.Context(), tc.args, &out, &errOut)
		assert.Equal(t, 1, code, "%v", tc.args)
		assert.Contains(t, errOut.String(), tc.want, "%v", tc.args)
	}
}

// TestRestoreHostsHold restores nothing and holds until the context ends,
// then exits 0, as the cleanup DaemonSet's container does on SIGTERM.
func TestRestoreHostsHold(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan int, 1)
	go func() {
		var out, errOut bytes.Buffer
		done <- run(ctx, []string{"restore-hosts", "--hold"}, &out, &errOut)
	}()
	select {
	case code := <-done:
		t.Fatalf("exited (%d) before the context ended", code)
	case <-time.After(100 * time.Millisecond):
	}
	cancel()
	assert.Equal(t, 0, <-done)
}

// TestWaitDaemonSetReady waits through a DaemonSet not there yet, then not
// yet seen by its controller, then partly ready, and returns once it is
// ready on every node.
func TestWaitDaemonSetReady(t *testing.T) {
	t.Parallel()
	cs := fake.NewClientset()
	ctx := t.Context()
	done := make(chan error, 1)
	var out syncBuffer
	go func() { done <- waitDaemonSetReady(ctx, cs, "ns", "cleanup", time.Millisecond, &out) }()

	step := func(want string) {
		t.Helper()
		require.Eventually(t, func() bool { return strings.Contains(out.String(), want) }, 10*time.Second, time.Millisecond, "no %q in %q", want, out.String())
		select {
		case err := <-done:
			t.Fatalf("returned (%v) at %q", err, want)
		default:
		}
	}
	step("to be created")
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "cleanup", Namespace: "ns", Generation: 1}}
	ds, err := cs.AppsV1().DaemonSets("ns").Create(ctx, ds, metav1.CreateOptions{})
	require.NoError(t, err)
	step("for the daemonset controller")
	ds.Status = appsv1.DaemonSetStatus{ObservedGeneration: 1, DesiredNumberScheduled: 3, UpdatedNumberScheduled: 3, NumberReady: 2}
	ds, err = cs.AppsV1().DaemonSets("ns").UpdateStatus(ctx, ds, metav1.UpdateOptions{})
	require.NoError(t, err)
	step("2 of 3 nodes ready")
	ds.Status.NumberReady = 3
	_, err = cs.AppsV1().DaemonSets("ns").UpdateStatus(ctx, ds, metav1.UpdateOptions{})
	require.NoError(t, err)
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("still waiting with every node ready")
	}
	assert.Contains(t, out.String(), "ready on all 3 nodes")

	// A cancelled wait is an error.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	assert.ErrorIs(t, waitDaemonSetReady(cctx, cs, "ns", "other", time.Millisecond, &out), context.Canceled)
}
