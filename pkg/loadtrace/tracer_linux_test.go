//go:build linux && amd64

package loadtrace

import (
	"bufio"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/api"
)

// requireRoot skips a test that loads BPF unless root, and fails it under
// CI=true (CI runs as root).
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		skipOrFail(t, "loading BPF needs root")
	}
}

func skipOrFail(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true but %s", why)
	}
	t.Skip(why)
}

// cacheDirs makes a cache root with models/ and blobs/sha256/.
func cacheDirs(t *testing.T) (root, models, blobs string) {
	t.Helper()
	root = t.TempDir()
	models = filepath.Join(root, "models")
	blobs = filepath.Join(root, "blobs", "sha256")
	require.NoError(t, os.MkdirAll(blobs, 0o755))
	require.NoError(t, os.MkdirAll(models, 0o755))
	return root, models, blobs
}

func writeFile(t *testing.T, path, content string) string {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
	return path
}

// startTracer runs a tracer until the test ends, once attached; a tracer
// that cannot attach skips the test (fails it under CI=true).
func startTracer(t *testing.T, cfg Config) (*Tracer, *prometheus.Registry) {
	t.Helper()
	requireRoot(t)
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	if cfg.Quiet == 0 {
		cfg.Quiet = 100 * time.Millisecond
	}
	tr, err := New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tr.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	for range 500 {
		if testutil.ToFloat64(tr.m.available) == 1 {
			return tr, reg
		}
		select {
		case err := <-done:
			done <- err
			skipOrFail(t, "the tracer did not attach (see the log)")
		case <-time.After(10 * time.Millisecond):
		}
	}
	t.Fatal("the tracer neither attached nor gave up")
	return nil, nil
}

// helper runs the test binary as a child in mode; it returns its stdout.
func helper(t *testing.T, cmdMod func(*exec.Cmd), mode string, args ...string) string {
	t.Helper()
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	cmd.Stderr = os.Stderr
	if cmdMod != nil {
		cmdMod(cmd)
	}
	out, err := cmd.Output()
	require.NoError(t, err, "helper %s", mode)
	return strings.TrimSpace(string(out))
}

// waitLoad waits for the ended load of model by pod.
func waitLoad(t *testing.T, tr *Tracer, pod, model string) api.ModelLoad {
	t.Helper()
	for range 1000 {
		for _, l := range tr.Loads() {
			if l.Model == model && l.Pod == pod && l.Open == 0 && !l.Started.IsZero() && tr.ended(l) {
				return l
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no ended load of %s by pod %q; loads: %+v", model, pod, tr.Loads())
	return api.ModelLoad{}
}

// ended says whether l is one of the ended loads.
func (t *Tracer) ended(l api.ModelLoad) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.recent {
		if r.Model == l.Model && r.Pod == l.Pod && r.Started.Equal(l.Started) {
			return true
		}
	}
	return false
}

func TestTracesModelLoad(t *testing.T) {
	root, models, blobs := cacheDirs(t)
	state := filepath.Join(root, "state")
	tr, reg := startTracer(t, Config{ModelsDirs: []string{models}, BlobsDirs: []string{blobs}, StateDir: state})

	snap := filepath.Join(models, "models--org--name", "snapshots", "rev1")
	a := writeFile(t, filepath.Join(snap, "a.safetensors"), "aaaa")
	b := writeFile(t, filepath.Join(snap, "b.safetensors"), "bbbb")
	c := writeFile(t, filepath.Join(snap, "sub", "c.json"), "{}")
	writeFile(t, filepath.Join(snap, "rel.txt"), "relative")
	hex := strings.Repeat("ab", 32)
	blob := writeFile(t, filepath.Join(blobs, hex), "blob")
	outside := writeFile(t, filepath.Join(root, "outside.txt"), "not traced")

	// Opened a, b, c, outside, blob, rel.txt (relative: not seen); read
	// last to first.
	out := helper(t, func(c *exec.Cmd) { c.Dir = snap }, "load", a, b, c, outside, blob, "rel:rel.txt")
	childSeconds, err := strconv.ParseFloat(out, 64)
	require.NoError(t, err, out)

	l := waitLoad(t, tr, "", "org/name@rev1")
	assert.Equal(t, []string{"sub/c.json", "b.safetensors", "a.safetensors"}, l.Order)
	assert.Equal(t, 3, l.Files)
	// The child slept 100ms with the files open, and timed more than the
	// tracer saw.
	assert.GreaterOrEqual(t, l.Seconds, 0.1)
	assert.LessOrEqual(t, l.Seconds, childSeconds)

	bl := waitLoad(t, tr, "", "sha256:"+hex)
	assert.Equal(t, 1, bl.Files)
	for _, x := range tr.Loads() {
		assert.Contains(t, []string{"org/name@rev1", "sha256:" + hex}, x.Model, "only the traced directories")
	}

	assert.Equal(t, l.Order, tr.Order("org/name@rev1"))
	assert.Equal(t, l.Order, tr.Order("org/name"), "by name: the latest revision")
	assert.Nil(t, tr.Order("org/other@rev1"))
	assert.Nil(t, tr.Order("sha256:"+hex), "blobs have no order")

	// The order survives a restart.
	again, err := New(Config{ModelsDirs: []string{models}, StateDir: state})
	require.NoError(t, err)
	assert.Equal(t, l.Order, again.Order("org/name@rev1"))

	assert.GreaterOrEqual(t, testutil.ToFloat64(tr.m.events.WithLabelValues("open")), 4.0)
	assert.GreaterOrEqual(t, testutil.ToFloat64(tr.m.events.WithLabelValues("read")), 4.0)
	assert.GreaterOrEqual(t, testutil.ToFloat64(tr.m.events.WithLabelValues("close")), 4.0)
	n, err := testutil.GatherAndCount(reg, "weightd_model_load_seconds")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
}

// cgroup2Mount returns where the cgroup v2 hierarchy is mounted ("" if not).
func cgroup2Mount(t *testing.T) string {
	f, err := os.Open("/proc/self/mounts")
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 2 && fields[2] == "cgroup2" {
			return fields[1]
		}
	}
	return ""
}

func TestAttributesLoadsToPods(t *testing.T) {
	requireRoot(t)
	mount := cgroup2Mount(t)
	if mount == "" {
		t.Skip("no cgroup v2 hierarchy mounted")
	}
	const uid = "0d1e2f3a-4b5c-4d6e-8f70-8192a3b4c5d6"
	pod := filepath.Join(mount, "kubepods.slice", "kubepods-burstable.slice",
		"kubepods-burstable-pod"+strings.ReplaceAll(uid, "-", "_")+".slice")
	ctr := filepath.Join(pod, "cri-containerd-"+strings.Repeat("c0", 32)+".scope")
	if err := os.MkdirAll(ctr, 0o755); err != nil {
		if os.IsPermission(err) || strings.Contains(err.Error(), "read-only") {
			t.Skipf("cgroup v2 at %s is read-only: %v", mount, err)
		}
		t.Fatalf("making a pod's cgroup: %v", err)
	}
	t.Cleanup(func() {
		for _, d := range []string{ctr, pod, filepath.Dir(pod), filepath.Dir(filepath.Dir(pod))} {
			os.Remove(d)
		}
	})
	cg, err := os.Open(ctr)
	require.NoError(t, err)
	defer cg.Close()

	_, models, _ := cacheDirs(t)
	tr, _ := startTracer(t, Config{ModelsDirs: []string{models}, CgroupRoot: mount,
		PodName: func(u string) string { return "ns/" + u }})
	f := writeFile(t, filepath.Join(models, "models--m", "snapshots", "main", "w.bin"), "w")
	helper(t, func(c *exec.Cmd) {
		c.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	}, "load", f)
	l := waitLoad(t, tr, "ns/"+uid, "m@main")
	assert.Equal(t, []string{"w.bin"}, l.Order)
}

func TestUnavailableKeepsWorking(t *testing.T) {
	_, models, _ := cacheDirs(t)
	if os.Geteuid() != 0 {
		// Not root: the load fails here, in this process.
		var logged logCounter
		tr, err := New(Config{ModelsDirs: []string{models}, Logger: slog.New(&logged)})
		require.NoError(t, err)
		require.NoError(t, tr.Run(context.Background()))
		assert.Equal(t, 0.0, testutil.ToFloat64(tr.m.available))
		assert.Equal(t, 1, logged.warnings)
		return
	}
	// Root: a child that drops to nobody before loading.
	var res unprivilegedResult
	require.NoError(t, json.Unmarshal([]byte(helper(t, nil, "unprivileged", models)), &res))
	assert.Equal(t, unprivilegedResult{Available: 0, Warnings: 1}, res)
}

func TestBurstDropsInsteadOfStalling(t *testing.T) {
	_, models, _ := cacheDirs(t)
	// The smallest ring buffer (one page) so that the burst overflows it.
	tr, reg := startTracer(t, Config{ModelsDirs: []string{models}, RingBytes: os.Getpagesize()})
	f := writeFile(t, filepath.Join(models, "models--m", "snapshots", "main", "w.bin"), "w")
	const n = 100_000
	out := helper(t, nil, "burst", strconv.Itoa(n), f)
	assert.Equal(t, "done 100000", out, "the opener finished")
	assert.Positive(t, tr.m.drops.total(), "drops counted")
	got, err := testutil.GatherAndCount(reg, "weightd_loadtrace_dropped_events_total")
	require.NoError(t, err)
	assert.Equal(t, len(dropReasons), got)
	assert.Positive(t, metricValue(t, reg, "weightd_loadtrace_dropped_events_total", "ringbuf"))
}

// metricValue returns the value of the counter name whose one label is value.
func metricValue(t *testing.T, reg *prometheus.Registry, name, value string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == value {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no %s{%q}", name, value)
	return 0
}
