package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
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

// TestReadmeManualCleanup runs the README's manual clean-up script, taken
// from README.md as written (so a change to the doc is what is tested), on
// a config directory where the agent wrote its files: the node's own
// hosts.toml comes back byte for byte, weightd's own file and directory
// go, a file weightd never wrote stays, and the cache goes.
func TestReadmeManualCleanup(t *testing.T) {
	t.Parallel()
	script := readmeCleanupScript(t)
	root := t.TempDir()
	paths := map[string]string{
		"/etc/containerd/certs.d":     filepath.Join(root, "certs.d"),
		"/var/lib/containerd/weightd": filepath.Join(root, "cache"),
		"/run/weightd":                filepath.Join(root, "run"),
	}
	for doc, real := range paths {
		require.Contains(t, script, doc, "the README's script no longer names %s: update this test", doc)
		script = strings.ReplaceAll(script, doc, real)
		require.NoError(t, os.MkdirAll(real, 0o755))
	}
	for _, p := range []string{"/etc/", "/var/", "/run/"} {
		require.NotContains(t, script, p, "a path this test does not redirect")
	}
	hosts := paths["/etc/containerd/certs.d"]
	own := []byte("server = \"https://ghcr.io\"\n[host.\"https://corp.example\"]\n  capabilities = [\"pull\"]\n")
	require.NoError(t, os.MkdirAll(filepath.Join(hosts, "ghcr.io"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(hosts, "ghcr.io", "hosts.toml"), own, 0o644))
	foreign := []byte("server = \"https://quay.io\"\n")
	require.NoError(t, os.MkdirAll(filepath.Join(hosts, "quay.io"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(hosts, "quay.io", "hosts.toml"), foreign, 0o644))
	require.NoError(t, mirror.ConfigureHosts(hosts, "http://127.0.0.1:5001", []string{"docker.io", "ghcr.io"}))
	require.NoError(t, os.WriteFile(filepath.Join(paths["/var/lib/containerd/weightd"], "blob"), []byte("x"), 0o644))

	out, err := exec.CommandContext(t.Context(), "sh", "-c", script).CombinedOutput()
	require.NoError(t, err, "%s", out)
	b, err := os.ReadFile(filepath.Join(hosts, "ghcr.io", "hosts.toml"))
	require.NoError(t, err)
	assert.Equal(t, string(own), string(b), "the node's hosts.toml is back")
	assert.NoFileExists(t, filepath.Join(hosts, "ghcr.io", "hosts.toml.weightd-backup"))
	assert.NoDirExists(t, filepath.Join(hosts, "docker.io"), "weightd's own file and directory are gone")
	b, err = os.ReadFile(filepath.Join(hosts, "quay.io", "hosts.toml"))
	require.NoError(t, err)
	assert.Equal(t, string(foreign), string(b), "a file weightd did not write stays")
	assert.NoDirExists(t, paths["/var/lib/containerd/weightd"])
	assert.NoDirExists(t, paths["/run/weightd"])
}

// readmeCleanupScript is the shell script the README's uninstall section
// has run on a node: the argument of `chroot /host sh -c '…'` in the sh
// block that restores hosts.toml.weightd-backup.
func readmeCleanupScript(t *testing.T) string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	const open, start = "```sh\n", "chroot /host sh -c '"
	for _, block := range strings.Split(string(readme), open)[1:] {
		block, _, _ = strings.Cut(block, "```")
		i := strings.Index(block, start)
		if i < 0 || !strings.Contains(block, "hosts.toml.weightd-backup") {
			continue
		}
		script := block[i+len(start):]
		end := strings.LastIndex(script, "'")
		require.Positive(t, end, "the script's closing quote")
		return script[:end]
	}
	t.Fatal("README.md has no sh block that runs the manual clean-up with chroot /host sh -c '…'")
	return ""
}
