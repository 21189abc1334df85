package pagecache

import (
	"bytes"
	"context"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

const mib = 1 << 20

// writeFile writes size random bytes to dir/name, fsynced so that its pages
// are clean and can be evicted.
func writeFile(t *testing.T, dir, name string, size int) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.MkdirAll(filepath.Dir(p), 0o755))
	b := make([]byte, size)
	_, _ = rand.NewChaCha8([32]byte{byte(size), byte(len(name))}).Read(b)
	f, err := os.Create(p)
	require.NoError(t, err)
	_, err = f.Write(b)
	require.NoError(t, err)
	require.NoError(t, f.Sync())
	require.NoError(t, f.Close())
	return p
}

// evict drops path's clean pages from the page cache (posix_fadvise
// DONTNEED, which needs no privilege) and checks that they are gone: a file
// system that keeps them anyway (tmpfs) skips the test, or fails it under
// CI=true.
func evict(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Sync())
	require.NoError(t, unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED))
	if size := fileSize(t, path); size > 0 && resident(t, path) == size {
		skipOrFail(t, "posix_fadvise(DONTNEED) leaves "+path+" in the page cache (tmpfs?); set TMPDIR to a disk")
	}
}

// resident measures how much of path is in the page cache, independently of
// any tier.
func resident(t *testing.T, path string) int64 {
	t.Helper()
	n, _, err := Resident(path)
	require.NoError(t, err)
	return n
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	require.NoError(t, err)
	return st.Size()
}

func skipOrFail(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true but %s", why)
	}
	t.Skip("skipping: " + why)
}

// lockedBytes is this process's VmLck.
func lockedBytes(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmLck:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmLck in /proc/self/status")
	return 0
}

func newTier(t *testing.T, budget int64, opts ...Option) *Tier {
	t.Helper()
	tier, err := New(budget, opts...)
	require.NoError(t, err)
	return tier
}

func fileStatus(t *testing.T, s Status, path string) FileStatus {
	t.Helper()
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		resolved = path
	}
	for _, f := range s.Files {
		if f.Path == resolved || f.Path == path {
			return f
		}
	}
	t.Fatalf("%s not in the status", path)
	return FileStatus{}
}

func TestKeepReadsEvictedFilesIn(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	paths := []string{
		writeFile(t, dir, "model/a.safetensors", 2*mib),
		writeFile(t, dir, "model/b.safetensors", mib+12345),
		writeFile(t, dir, "model/config.json", 100),
		writeFile(t, dir, "model/empty", 0),
	}
	var total int64
	for _, p := range paths {
		evict(t, p)
		require.Zero(t, resident(t, p))
		total += fileSize(t, p)
	}
	reg := prometheus.NewRegistry()
	tier := newTier(t, 64*mib, WithMlock(false), WithRegisterer(reg))
	require.NoError(t, tier.Keep(t.Context(), "server-a", []string{filepath.Join(dir, "model")}))
	for _, p := range paths {
		require.Equal(t, fileSize(t, p), resident(t, p), "%s is resident after Keep", p)
	}
	s := tier.Status()
	require.Equal(t, int64(64*mib), s.Budget)
	require.Equal(t, total, s.Kept)
	require.Equal(t, total, s.Resident)
	require.Zero(t, s.Locked)
	require.False(t, s.MlockAvailable)
	require.Len(t, s.Files, 4)
	for i, f := range s.Files {
		require.True(t, f.Kept, f.Path)
		require.NoError(t, f.Err)
		require.Equal(t, []string{"server-a"}, f.Owners)
		require.Equal(t, paths[i], f.Path, "lexical order")
	}
	require.Equal(t, float64(64*mib), testutil.ToFloat64(gauge(t, reg, "weightd_dram_tier_budget_bytes")))
	require.Equal(t, float64(total), testutil.ToFloat64(gauge(t, reg, "weightd_dram_tier_kept_bytes")))
	require.Equal(t, float64(total), testutil.ToFloat64(gauge(t, reg, "weightd_dram_tier_resident_bytes")))
	require.Zero(t, testutil.ToFloat64(gauge(t, reg, "weightd_dram_tier_mlock_available")))
	require.Equal(t, float64(total), testutil.ToFloat64(gauge(t, reg, "weightd_dram_tier_rewarmed_bytes_total")))
	tier.Release("server-a")
	require.Zero(t, tier.Status().Kept)
}

// gauge finds the single-series metric name in reg.
func gauge(t *testing.T, reg *prometheus.Registry, name string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: name})
			g.Set(v)
			return g
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

func TestKeepLocksAndReleaseUnlocks(t *testing.T) {
	// Not parallel: it measures this process's locked memory.
	dir := t.TempDir()
	p := writeFile(t, dir, "blob", 2*mib)
	evict(t, p)
	tier := newTier(t, 4*mib)
	before := lockedBytes(t)
	require.NoError(t, tier.Keep(t.Context(), "server-a", []string{p}))
	s := tier.Status()
	if !s.MlockAvailable {
		skipOrFail(t, "mlock of 2 MiB refused (RLIMIT_MEMLOCK below 2 MiB and no CAP_IPC_LOCK)")
	}
	require.Equal(t, int64(2*mib), s.Locked)
	require.Equal(t, int64(2*mib), s.Resident)
	require.True(t, fileStatus(t, s, p).Locked)
	require.GreaterOrEqual(t, lockedBytes(t)-before, int64(2*mib))

	// Locked pages survive DONTNEED.
	require.NoError(t, unix.Fadvise(int(mustOpen(t, p).Fd()), 0, 0, unix.FADV_DONTNEED))
	require.Equal(t, int64(2*mib), resident(t, p))

	tier.Release("server-a")
	require.Equal(t, before, lockedBytes(t))
	s = tier.Status()
	require.Zero(t, s.Locked)
	require.Zero(t, s.Kept)
	require.Empty(t, s.Files)
}

func mustOpen(t *testing.T, p string) *os.File {
	t.Helper()
	f, err := os.Open(p)
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

func TestMlockRefusedFallsBackToRewarming(t *testing.T) {
	t.Parallel()
	for _, refusal := range []error{unix.EPERM, unix.ENOMEM} {
		t.Run(refusal.Error(), func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			a := writeFile(t, dir, "a", mib)
			b := writeFile(t, dir, "b", mib)
			var logs syncBuffer
			reg := prometheus.NewRegistry()
			tier := newTier(t, 4*mib, WithInterval(10*time.Millisecond), WithRegisterer(reg),
				WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
			var calls int
			tier.lockMem = func([]byte) error { calls++; return refusal }

			require.NoError(t, tier.Keep(t.Context(), "server-a", []string{a, b}))
			s := tier.Status()
			require.False(t, s.MlockAvailable)
			require.Zero(t, s.Locked)
			require.Equal(t, int64(2*mib), s.Kept)
			require.Equal(t, int64(2*mib), s.Resident)
			require.Equal(t, 1, calls, "mlock is not tried again once refused")
			require.Equal(t, 1, strings.Count(logs.String(), "mlock refused"), "logged once")
			require.Zero(t, testutil.ToFloat64(gauge(t, reg, "weightd_dram_tier_mlock_available")))

			// The re-warm loop keeps them instead.
			evict(t, a)
			runUntil(t, tier, func() bool { return resident(t, a) == mib })
			require.Equal(t, 1, calls)
			require.Equal(t, 1, strings.Count(logs.String(), "mlock refused"))
		})
	}
}

// runUntil runs tier.Run until done says so; it fails the test if that takes
// a minute (a hang, not a slow machine).
func runUntil(t *testing.T, tier *Tier, done func() bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- tier.Run(ctx) }()
	deadline := time.Now().Add(time.Minute)
	for !done() {
		if time.Now().After(deadline) {
			cancel()
			t.Fatal("Run did not get there in a minute")
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	require.NoError(t, <-errc)
}

func TestRunRewarmsEvictedFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a := writeFile(t, dir, "a", 3*mib)
	b := writeFile(t, dir, "b", 100)
	tier := newTier(t, 4*mib, WithMlock(false), WithInterval(10*time.Millisecond), WithWarmRate(64*mib))
	require.NoError(t, tier.Keep(t.Context(), "server-a", []string{a, b}))
	evict(t, a)
	evict(t, b)
	runUntil(t, tier, func() bool {
		return resident(t, a) == 3*mib && resident(t, b) == 100 && tier.Status().Resident == 3*mib+100
	})
}

func TestSharedFilesCountOnce(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	blob1 := writeFile(t, dir, "blobs/1", mib)
	blob2 := writeFile(t, dir, "blobs/2", 2*mib)
	blob3 := writeFile(t, dir, "blobs/3", mib)
	link := func(model, name, target string) {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, model), 0o755))
		rel, err := filepath.Rel(filepath.Join(dir, model), target)
		require.NoError(t, err)
		require.NoError(t, os.Symlink(rel, filepath.Join(dir, model, name)))
	}
	link("models/one", "a.safetensors", blob1)
	link("models/one", "b.safetensors", blob2)
	link("models/two", "b.safetensors", blob2)
	link("models/two", "c.safetensors", blob3)
	// A hard link is the same file too.
	require.NoError(t, os.Link(blob3, filepath.Join(dir, "hard3")))

	tier := newTier(t, 4*mib, WithMlock(false))
	require.NoError(t, tier.Keep(t.Context(), "server-a", []string{filepath.Join(dir, "models/one")}))
	require.NoError(t, tier.Keep(t.Context(), "server-b", []string{filepath.Join(dir, "models/two"), filepath.Join(dir, "hard3")}))
	s := tier.Status()
	require.Equal(t, int64(4*mib), s.Kept, "the shared blob counts once")
	require.Len(t, s.Files, 3)
	require.Equal(t, []string{"server-a", "server-b"}, fileStatus(t, s, blob2).Owners)
	require.Equal(t, blob1, s.Files[0].Path, "symlinks resolved")

	tier.Release("server-a")
	s = tier.Status()
	require.Equal(t, int64(3*mib), s.Kept)
	require.Len(t, s.Files, 2)
	require.Equal(t, []string{"server-b"}, fileStatus(t, s, blob2).Owners)
	require.True(t, fileStatus(t, s, blob2).Kept)
	tier.Release("server-b")
	require.Empty(t, tier.Status().Files)
}

func TestBudget(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a1 := writeFile(t, dir, "a1", 2*mib)
	a2 := writeFile(t, dir, "a2", 2*mib)
	a3 := writeFile(t, dir, "a3", mib)
	b1 := writeFile(t, dir, "b1", mib)
	reg := prometheus.NewRegistry()
	tier := newTier(t, 3*mib, WithRegisterer(reg))

	err := tier.Keep(t.Context(), "server-a", []string{a1, a2, a3})
	require.ErrorIs(t, err, ErrOverBudget)
	require.ErrorContains(t, err, a2)
	require.NotContains(t, err.Error(), a3)
	s := tier.Status()
	require.Equal(t, int64(3*mib), s.Kept, "first fit, in the order given")
	require.LessOrEqual(t, s.Locked, s.Budget)
	require.True(t, fileStatus(t, s, a1).Kept)
	require.ErrorIs(t, fileStatus(t, s, a2).Err, ErrOverBudget)
	require.False(t, fileStatus(t, s, a2).Kept)
	require.True(t, fileStatus(t, s, a3).Kept)

	// A later owner comes after: nothing is left for it.
	require.ErrorIs(t, tier.Keep(t.Context(), "server-b", []string{b1}), ErrOverBudget)
	require.Equal(t, 2.0, testutil.ToFloat64(gaugeVec(t, reg, "over_budget")))
	require.Equal(t, 2.0, testutil.ToFloat64(gaugeVec(t, reg, "kept")))

	// Releasing the first admits it; the next check reads it in.
	tier.Release("server-a")
	s = tier.Status()
	require.True(t, fileStatus(t, s, b1).Kept)
	require.Equal(t, int64(mib), s.Kept)
	evict(t, b1)
	require.NoError(t, tier.Check(t.Context()))
	require.Equal(t, int64(mib), resident(t, b1))
	require.Equal(t, int64(mib), tier.Status().Resident)

	// Re-keeping an owner replaces its files and keeps its place.
	require.NoError(t, tier.Keep(t.Context(), "server-a", []string{a1}))
	s = tier.Status()
	require.Equal(t, a1, s.Files[1].Path, "server-a now comes after server-b")
	require.Equal(t, int64(3*mib), s.Kept)
	require.NoError(t, tier.Keep(t.Context(), "server-b", []string{b1, a2}))
	s = tier.Status()
	require.Equal(t, []string{b1, a2, a1}, paths(s), "server-b keeps its place")
	require.ErrorIs(t, fileStatus(t, s, a1).Err, ErrOverBudget)
	require.ErrorIs(t, tier.Check(t.Context()), ErrOverBudget)
	tier.Release("server-a")
	tier.Release("server-b")
}

func paths(s Status) []string {
	var ps []string
	for _, f := range s.Files {
		ps = append(ps, f.Path)
	}
	return ps
}

func gaugeVec(t *testing.T, reg *prometheus.Registry, state string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "weightd_dram_tier_files" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == state {
				g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g", Help: "g"})
				g.Set(m.GetGauge().GetValue())
				return g
			}
		}
	}
	t.Fatalf("no weightd_dram_tier_files{state=%q}", state)
	return nil
}

func TestVanishedAndTruncatedFilesAreReported(t *testing.T) {
	t.Parallel()
	for _, mlock := range []bool{false, true} {
		t.Run("mlock="+strconv.FormatBool(mlock), func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			gone := writeFile(t, dir, "gone", mib)
			cut := writeFile(t, dir, "cut", 2*mib)
			replaced := writeFile(t, dir, "replaced", mib)
			fine := writeFile(t, dir, "fine", mib)
			reg := prometheus.NewRegistry()
			tier := newTier(t, 8*mib, WithMlock(mlock), WithRegisterer(reg))
			require.NoError(t, tier.Keep(t.Context(), "server-a", []string{gone, cut, replaced, fine}))

			require.NoError(t, os.Remove(gone))
			require.NoError(t, os.Truncate(cut, mib/2))
			writeFile(t, dir, "replaced.new", mib)
			require.NoError(t, os.Rename(filepath.Join(dir, "replaced.new"), replaced))

			err := tier.Check(t.Context())
			require.ErrorIs(t, err, fs.ErrNotExist)
			require.ErrorIs(t, err, ErrChanged)
			s := tier.Status()
			require.Equal(t, int64(mib), s.Kept)
			require.Equal(t, int64(mib), s.Resident)
			for _, p := range []string{gone, cut, replaced} {
				f := fileStatus(t, s, p)
				require.False(t, f.Kept, p)
				require.Error(t, f.Err, p)
				require.NotEmpty(t, f.Error, p)
			}
			require.ErrorIs(t, fileStatus(t, s, gone).Err, fs.ErrNotExist)
			require.ErrorIs(t, fileStatus(t, s, cut).Err, ErrChanged)
			require.ErrorIs(t, fileStatus(t, s, replaced).Err, ErrChanged)
			require.True(t, fileStatus(t, s, fine).Kept)
			require.Equal(t, 3.0, testutil.ToFloat64(gaugeVec(t, reg, "failed")))

			// Keeping them again takes them as they are now.
			require.ErrorIs(t, tier.Keep(t.Context(), "server-a", []string{gone, cut, replaced, fine}), fs.ErrNotExist)
			s = tier.Status()
			require.Equal(t, int64(mib/2+2*mib), s.Kept)
			tier.Release("server-a")
		})
	}
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	_, err := New(-1)
	require.ErrorIs(t, err, ErrInvalid)
	for _, opt := range []Option{WithInterval(0), WithWarmConcurrency(0), WithWarmRate(-1), WithLogger(nil)} {
		_, err := New(1, opt)
		require.ErrorIs(t, err, ErrInvalid)
	}
	reg := prometheus.NewRegistry()
	_, err = New(1, WithRegisterer(reg))
	require.NoError(t, err)
	_, err = New(1, WithRegisterer(reg))
	require.Error(t, err, "metrics registered twice")

	dir := t.TempDir()
	tier := newTier(t, mib)
	require.ErrorIs(t, tier.Keep(t.Context(), "", []string{dir}), ErrInvalid)
	require.NoError(t, os.Mkdir(filepath.Join(dir, "sub"), 0o755))
	require.NoError(t, os.Symlink("nowhere", filepath.Join(dir, "sub", "dangling")))
	require.NoError(t, os.Symlink(filepath.Join(dir, "sub"), filepath.Join(dir, "dirlink")))

	err = tier.Keep(t.Context(), "server-a", []string{filepath.Join(dir, "missing"), filepath.Join(dir, "sub", "dangling"), "/dev/null"})
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.ErrorIs(t, err, ErrInvalid, "/dev/null is not a regular file")
	s := tier.Status()
	require.Len(t, s.Files, 3)
	for _, f := range s.Files {
		require.False(t, f.Kept)
		require.Error(t, f.Err)
	}
	require.ErrorIs(t, tier.Check(t.Context()), fs.ErrNotExist)

	// Under a directory, what is not a regular file is skipped, a dangling
	// link reported.
	err = tier.Keep(t.Context(), "server-a", []string{dir})
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.Len(t, tier.Status().Files, 1)

	tier.Release("server-a")
	tier.Release("never-kept")
	require.Empty(t, tier.Status().Files)

	_, _, err = Resident(filepath.Join(dir, "missing"))
	require.ErrorIs(t, err, fs.ErrNotExist)
	empty := writeFile(t, dir, "empty", 0)
	n, size, err := Resident(empty)
	require.NoError(t, err)
	require.Zero(t, n+size)
}

func TestKeepCancelled(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	p := writeFile(t, dir, "a", mib)
	tier := newTier(t, 2*mib, WithMlock(false))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.ErrorIs(t, tier.Keep(ctx, "server-a", []string{p}), context.Canceled)
	require.True(t, tier.Status().Files[0].Kept, "kept; Run reads it in")
	require.ErrorIs(t, tier.Check(ctx), context.Canceled)
}

func TestConcurrentUse(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	var ps []string
	for i := range 4 {
		ps = append(ps, writeFile(t, dir, "f"+strconv.Itoa(i), 256<<10))
	}
	tier := newTier(t, 768<<10, WithInterval(time.Millisecond))
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- tier.Run(ctx) }()
	var owners sync.WaitGroup
	for i := range 4 {
		owners.Go(func() {
			owner := "server-" + strconv.Itoa(i)
			for range 20 {
				_ = tier.Keep(ctx, owner, ps[i:])
				if s := tier.Status(); s.Kept > s.Budget || s.Locked > s.Kept {
					t.Errorf("kept %d, locked %d, budget %d", s.Kept, s.Locked, s.Budget)
				}
				tier.Release(owner)
			}
		})
	}
	owners.Wait()
	cancel()
	require.NoError(t, <-errc)
	s := tier.Status()
	require.Empty(t, s.Files)
	require.Zero(t, s.Locked)
}

// syncBuffer is a bytes.Buffer for a logger written from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestLocksNoMoreThanTheLockCap(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a := writeFile(t, dir, "a", mib)
	b := writeFile(t, dir, "b", mib)
	c := writeFile(t, dir, "c", mib/2)
	tier := newTier(t, 4*mib)
	tier.lockCap = 3 * mib / 2 // as if half the cgroup's memory.max
	var locked []int
	tier.lockMem = func(m []byte) error { locked = append(locked, len(m)); return nil }
	tier.unlockMem = func([]byte) error { return nil }
	require.NoError(t, tier.Keep(t.Context(), "server-a", []string{a, b, c}))
	s := tier.Status()
	require.Equal(t, []int{mib, mib / 2}, locked, "b would go over the cap; c fits")
	require.Equal(t, int64(3*mib/2), s.Locked)
	require.True(t, s.MlockAvailable, "not a refusal")
	require.False(t, fileStatus(t, s, b).Locked)
	require.Equal(t, int64(5*mib/2), s.Resident)
	tier.Release("server-a")
}
