package loadtrace

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// These tests feed the aggregation events by hand; the BPF side is tested
// with real processes in tracer_linux_test.go.

const testModels = "/cache/models"

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func newTestTracer(t *testing.T, cfg Config) *Tracer {
	t.Helper()
	cfg.ModelsDirs = []string{testModels}
	cfg.BlobsDirs = []string{"/cache/blobs/sha256"}
	cfg.CgroupRoot = t.TempDir() // no pods: every cgroup is outside one
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.NewRegistry()
	}
	tr, err := New(cfg)
	require.NoError(t, err)
	return tr
}

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

func modelPath(model, rev, file string) string {
	return testModels + "/models--" + strings.ReplaceAll(model, "/", "--") + "/snapshots/" + rev + "/" + file
}

func TestLoadSpansQuietGaps(t *testing.T) {
	tr := newTestTracer(t, Config{Quiet: time.Second})
	p := modelPath("org/m", "r", "a")
	tr.handle(event{kind: kindOpen, time: at(0), tgid: 1, fd: 3, path: p})
	tr.handle(event{kind: kindRead, time: at(10), tgid: 1, fd: 3})
	tr.handle(event{kind: kindClose, time: at(100), tgid: 1, fd: 3})
	tr.tick(at(500)) // within the quiet period: not ended
	tr.handle(event{kind: kindOpen, time: at(600), tgid: 1, fd: 3, path: modelPath("org/m", "r", "b")})
	tr.handle(event{kind: kindRead, time: at(610), tgid: 1, fd: 3})
	tr.handle(event{kind: kindClose, time: at(700), tgid: 1, fd: 3})
	tr.tick(at(1500))
	require.Len(t, tr.active, 1, "closed 800ms ago: still in progress")
	tr.tick(at(1700))
	loads := tr.Loads()
	require.Len(t, loads, 1)
	assert.Equal(t, 0.7, loads[0].Seconds)
	assert.Equal(t, []string{"a", "b"}, loads[0].Order)
	assert.Equal(t, []string{"a", "b"}, tr.Order("org/m@r"))
}

func TestExitClosesAndReopenReplaces(t *testing.T) {
	tr := newTestTracer(t, Config{Quiet: time.Millisecond})
	tr.handle(event{kind: kindOpen, time: at(0), tgid: 7, fd: 3, path: modelPath("m", "r", "a")})
	tr.handle(event{kind: kindOpen, time: at(1), tgid: 7, fd: 4, path: modelPath("m", "r", "b")})
	// fd 3 opened again: its close was not seen.
	tr.handle(event{kind: kindOpen, time: at(2), tgid: 7, fd: 3, path: modelPath("m", "r", "c")})
	require.Equal(t, 2, tr.Loads()[0].Open)
	tr.handle(event{kind: kindExit, time: at(50), tgid: 7, fd: -1})
	assert.Empty(t, tr.fds)
	tr.tick(at(100))
	l := tr.Loads()[0]
	assert.Equal(t, 0, l.Open)
	assert.Equal(t, 0.05, l.Seconds)
	assert.Equal(t, 3, l.Files)
	assert.Nil(t, tr.Order("m@r"), "nothing was read")
}

func TestBounds(t *testing.T) {
	tr := newTestTracer(t, Config{MaxLoads: 2, MaxFiles: 2, Recent: 1, MaxLoadAge: time.Minute})
	for i, m := range []string{"a", "b", "c"} {
		tr.handle(event{kind: kindOpen, time: at(i), tgid: 1, fd: int32(10 + i), path: modelPath(m, "r", "f")})
	}
	assert.Len(t, tr.active, 2, "the third load is beyond MaxLoads")
	assert.Equal(t, uint64(1), tr.m.drops.total(), "counted as dropped (bounds)")
	for i, f := range []string{"x", "y", "z"} {
		tr.handle(event{kind: kindOpen, time: at(10 + i), tgid: 2, fd: int32(i), path: modelPath("a", "r", f)})
		tr.handle(event{kind: kindRead, time: at(10 + i), tgid: 2, fd: int32(i)})
	}
	for _, l := range tr.Loads() {
		if l.Model == "a@r" {
			assert.Equal(t, 2, l.Files, "MaxFiles")
			assert.Equal(t, []string{"x"}, l.Order, "f was opened first but not read; z is beyond MaxFiles")
		}
	}
	// Never closed: dropped after MaxLoadAge, unmeasured.
	tr.tick(at(2).Add(time.Minute))
	assert.Empty(t, tr.active)
	assert.Empty(t, tr.fds)
	assert.Empty(t, tr.Loads())
}

func TestOrderStore(t *testing.T) {
	dir := t.TempDir()
	s := newOrderStore(dir, 2, 2, nil)
	require.NoError(t, s.set("org/m@r1", []string{"a", "b", "c"}, at(1)))
	require.NoError(t, s.set("org/m@r2", []string{"b"}, at(2)))
	assert.Equal(t, []string{"a", "b"}, s.get("org/m@r1"), "MaxFiles")
	assert.Equal(t, []string{"b"}, s.get("org/m"), "latest revision")
	assert.Equal(t, []string{"b"}, s.get("org/m@r3"), "unknown revision: latest")
	assert.Nil(t, s.get("org"))
	require.NoError(t, s.set("other@r", []string{"x"}, at(3)))
	assert.NotContains(t, s.m, "org/m@r1", "MaxModels: the oldest forgotten")
	assert.Equal(t, []string{"b"}, s.get("org/m@r1"), "forgotten: the latest revision kept")

	again := newOrderStore(dir, 2, 2, nil)
	assert.Equal(t, []string{"x"}, again.get("other@r"))
	assert.Equal(t, []string{"b"}, again.get("org/m@r2"))

	require.NoError(t, os.WriteFile(filepath.Join(dir, orderFile), []byte("{not json"), 0o644))
	var logged logCounter
	broken := newOrderStore(dir, 2, 2, slog.New(&logged))
	assert.Nil(t, broken.get("other@r"))
	assert.Equal(t, 1, logged.warnings)
}

func TestNewRejects(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{ModelsDirs: []string{"relative"}},
		{ModelsDirs: []string{"/"}},
		{ModelsDirs: []string{"/" + strings.Repeat("x", MaxPrefixLen)}},
		{ModelsDirs: []string{"/a", "/b", "/c"}, BlobsDirs: []string{"/d", "/e"}},
		{ModelsDirs: []string{"/a"}, RingBytes: 5000},
	} {
		_, err := New(cfg)
		assert.Error(t, err, "%+v", cfg)
	}
}

func TestClassify(t *testing.T) {
	models, blobs := []string{"/c/models/", "/pod/hub/"}, []string{"/c/blobs/sha256/"}
	hex := strings.Repeat("0f", 32)
	for _, tc := range []struct {
		path, model, file string
		blob, ok          bool
	}{
		{"/c/models/models--org--name/snapshots/abc/w.safetensors", "org/name@abc", "w.safetensors", false, true},
		{"/pod/hub/models--gpt2/snapshots/main/sub/dir/x.json", "gpt2@main", "sub/dir/x.json", false, true},
		{"/c/models//models--a--b/./snapshots/r/f", "a/b@r", "f", false, true},
		{"/c/blobs/sha256/" + hex, "sha256:" + hex, "sha256:" + hex, true, true},
		{"/c/blobs/sha256/" + hex[:10], "", "", false, false},
		{"/c/models/models--a--b/snapshots/.tmp-1/f", "", "", false, false},
		{"/c/models/models--a--b/refs/main", "", "", false, false},
		{"/c/models/models--a--b/snapshots/r", "", "", false, false},
		{"/c/models/datasets--a/snapshots/r/f", "", "", false, false},
		{"/c/models/models--a--b--c/snapshots/r/f", "a/b/c@r", "f", false, true}, // a model fetched by URL
		{"/c/models/models--a--b--c--d/snapshots/r/f", "", "", false, false},
		{"/c/models/../etc/passwd", "", "", false, false},
		{"/c/modelsX/models--a/snapshots/r/f", "", "", false, false},
		{"/etc/passwd", "", "", false, false},
	} {
		model, file, blob, ok := classify(models, blobs, tc.path)
		assert.Equal(t, []any{tc.model, tc.file, tc.blob, tc.ok}, []any{model, file, blob, ok}, tc.path)
	}
}

// FuzzClassify: any path the kernel reports (a process's string, up to 511
// bytes) classifies without panicking into a valid model and a clean,
// relative file.
func FuzzClassify(f *testing.F) {
	f.Add("/c/models/models--org--name/snapshots/abc/w.safetensors")
	f.Add("/c/blobs/sha256/" + strings.Repeat("0f", 32))
	f.Add("/c/models/models--a/snapshots/r/../../x")
	f.Fuzz(func(t *testing.T, p string) {
		model, file, blob, ok := classify([]string{"/c/models/"}, []string{"/c/blobs/sha256/"}, p)
		if !ok {
			return
		}
		if blob {
			assert.Equal(t, model, file)
			return
		}
		assert.True(t, validFile(file), "file %q", file)
		assert.Contains(t, model, "@")
	})
}

// FuzzDecodeOrders: a persisted order file, whatever its content, decodes
// within the bounds into valid entries or fails.
func FuzzDecodeOrders(f *testing.F) {
	f.Add([]byte(`{"version":1,"models":{"org/m@r":{"updated":"2026-01-02T03:04:05Z","files":["a","b/c"]}}}`))
	f.Add([]byte(`{"version":1,"models":{"org/m@r":{"files":["/abs","../x","a/../b",""]}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeOrders(b, 3, 4)
		if err != nil {
			return
		}
		assert.LessOrEqual(t, len(m), 3)
		for k, e := range m {
			assert.Contains(t, k, "@")
			assert.NotEmpty(t, e.Files)
			assert.LessOrEqual(t, len(e.Files), 4)
			for _, f := range e.Files {
				assert.True(t, validFile(f), f)
			}
		}
	})
}

// logCounter is a slog.Handler counting warnings.
type logCounter struct{ warnings int }

func (l *logCounter) Enabled(context.Context, slog.Level) bool { return true }
func (l *logCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Level == slog.LevelWarn {
		l.warnings++
	}
	return nil
}
func (l *logCounter) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logCounter) WithGroup(string) slog.Handler      { return l }
