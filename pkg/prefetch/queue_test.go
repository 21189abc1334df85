package prefetch_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/genmodel/genmodeltest"
	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

var _ prefetch.Store = (*cache.Store)(nil)

// assertModelDir checks that dir holds the files of m with the bytes the
// origin serves from originDir.
func assertModelDir(t *testing.T, dir, originDir string, m *genmodel.Manifest) {
	t.Helper()
	for _, f := range m.Files {
		got, err := os.ReadFile(filepath.Join(dir, f.Path))
		require.NoError(t, err)
		want, err := os.ReadFile(filepath.Join(originDir, f.Path))
		require.NoError(t, err)
		assert.True(t, slices.Equal(want, got), "%s differs", f.Path)
	}
}

// startOriginDir serves a generated model and returns the server, the
// manifest and the served directory.
func startOriginDir(t *testing.T, spec genmodel.Spec, opts ...genmodel.ServerOption) (*genmodel.Server, *genmodel.Manifest, string) {
	t.Helper()
	o := genmodeltest.Start(t, spec, opts...)
	return o.Server, o.Manifest, o.Dir
}

func TestQueueFetchesModel(t *testing.T) {
	t.Parallel()
	spec := genmodel.Spec{Name: "org/llama", Files: 6, TotalBytes: 3<<20 + 17, Seed: 1}
	srv, m, dir := startOriginDir(t, spec)
	store := sourcetest.OpenStore(t)
	reg := prometheus.NewPedanticRegistry()
	q := prefetch.NewQueue(store, httpsource.New(nil), prefetch.WithRegisterer(reg),
		prefetch.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	r := srv.URL() + "/" + genmodel.ManifestName

	j, err := q.Submit(r, prefetch.PriorityNormal)
	require.NoError(t, err)
	again, err := q.Submit(r, prefetch.PriorityNormal)
	require.NoError(t, err)
	assert.Same(t, j, again, "same reference while unfinished: same job")
	assert.Equal(t, prefetch.StateQueued, j.Status().State)

	sourcetest.RunQueue(t, q)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Equal(t, prefetch.StateReady, st.State)
	pref, err := ref.Parse(r)
	require.NoError(t, err)
	assert.Equal(t, source.ModelName(pref), st.Model, "named after its URL, not as the manifest names itself")
	assert.Equal(t, m.Revision, st.Revision)
	assert.Equal(t, m.TotalBytes(), st.BytesTotal)
	assert.Equal(t, st.BytesTotal, st.BytesDone)
	assert.Equal(t, 6, st.FilesTotal)
	assert.Equal(t, 6, st.FilesDone)
	assert.Empty(t, st.Error)
	assert.False(t, st.Started.Before(st.Created))
	assert.False(t, st.Finished.Before(st.Started))
	want, err := store.ModelDir(source.ModelName(pref), m.Revision)
	require.NoError(t, err)
	assert.Equal(t, want, st.Dir)
	assertModelDir(t, st.Dir, dir, m)
	egress := srv.BytesServed()
	assert.Less(t, egress, m.TotalBytes()+(64<<10), "each byte fetched about once")

	// Finished jobs are not deduplicated: a new job, served from the cache.
	j2, err := q.Submit(r, prefetch.PriorityNormal)
	require.NoError(t, err)
	assert.NotEqual(t, j.ID(), j2.ID())
	st2, err := sourcetest.Wait(t, j2)
	require.NoError(t, err)
	assert.Equal(t, st.Dir, st2.Dir)
	assert.Equal(t, egress+int64(len(mustRead(t, filepath.Join(dir, genmodel.ManifestName)))), srv.BytesServed(), "only the manifest again")

	got, ok := q.Job(j.ID())
	require.True(t, ok)
	assert.Same(t, j, got)
	jobs := q.Jobs()
	require.Len(t, jobs, 2)
	assert.Equal(t, j.ID(), jobs[0].ID)

	assert.InDelta(t, 2, metricValue(t, reg, "weightd_prefetch_jobs_total", "ready"), 0)
	assert.InDelta(t, 0, metricValue(t, reg, "weightd_prefetch_jobs_total", "failed"), 0)
	n, err := testutil.GatherAndCount(reg, "weightd_prefetch_job_seconds", "weightd_prefetch_queue_depth")
	require.NoError(t, err)
	assert.Equal(t, 2, n)
}

func mustRead(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(name)
	require.NoError(t, err)
	return data
}

// metricValue reads a counter or gauge from reg: name, with the label
// outcome=outcome unless outcome is empty.
// metricValue is the value of the counter or gauge name with the label
// outcome (any other labels: kind=http), or without labels for outcome "".
func metricValue(t *testing.T, reg *prometheus.Registry, name, outcome string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if outcome != "" && !hasLabels(m.GetLabel(), map[string]string{"kind": "http", "outcome": outcome}) {
				continue
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s{outcome=%q}", name, outcome)
	return 0
}

func TestQueueSingleFile(t *testing.T) {
	t.Parallel()
	srv, m, dir := startOriginDir(t, genmodel.Spec{Name: "org/one", Files: 1, TotalBytes: 500_000, Seed: 2})
	q := prefetch.NewQueue(sourcetest.OpenStore(t), httpsource.New(nil))
	sourcetest.RunQueue(t, q)
	f := m.Files[0]
	j, err := q.Submit(srv.URL()+"/"+f.Path+"#"+f.Digest().String(), prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Equal(t, f.Digest().Encoded()[:12], st.Revision)
	assert.Equal(t, mustRead(t, filepath.Join(dir, f.Path)), mustRead(t, filepath.Join(st.Dir, f.Path)))
}

func TestQueueSurvivesFaultyOrigin(t *testing.T) {
	t.Parallel()
	spec := genmodel.Spec{Name: "org/faulty", Files: 3, TotalBytes: 2 << 20, Seed: 3}
	srv, m, dir := startOriginDir(t, spec,
		genmodel.WithDrop(genmodel.Fault{Path: "model.safetensors", After: 300 << 10, Times: 2}),
		genmodel.WithStall(genmodel.Fault{Path: "tokenizer.json", After: 1000, Times: 1}),
	)
	q := prefetch.NewQueue(sourcetest.OpenStore(t), httpsource.New(nil))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(srv.URL()+"/"+genmodel.ManifestName, prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err, "the cache retries and resumes")
	assertModelDir(t, st.Dir, dir, m)
}

func TestQueueCorruptOriginFailsThenRecovers(t *testing.T) {
	t.Parallel()
	spec := genmodel.Spec{Name: "org/corrupt", Files: 1, TotalBytes: 1 << 20, Seed: 4}
	srv, m, dir := startOriginDir(t, spec, genmodel.WithCorrupt(genmodel.Fault{After: 12345, Times: 1}))
	reg := prometheus.NewRegistry()
	q := prefetch.NewQueue(sourcetest.OpenStore(t), httpsource.New(nil), prefetch.WithRegisterer(reg))
	sourcetest.RunQueue(t, q)
	ref := srv.URL() + "/" + genmodel.ManifestName

	j, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.ErrorIs(t, err, content.ErrDigestMismatch)
	assert.Equal(t, prefetch.StateFailed, st.State)
	assert.Contains(t, st.Error, "model.safetensors")
	assert.Empty(t, st.Dir)

	j2, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	assert.NotEqual(t, j.ID(), j2.ID(), "a failed job can be resubmitted")
	st, err = sourcetest.Wait(t, j2)
	require.NoError(t, err)
	assertModelDir(t, st.Dir, dir, m)
	assert.InDelta(t, 1, metricValue(t, reg, "weightd_prefetch_jobs_total", "failed"), 0)
}

func TestQueuePermanentErrorNotRetried(t *testing.T) {
	t.Parallel()
	srv := genmodeltest.Start(t, genmodel.Spec{Name: "org/x", Files: 1, TotalBytes: 10})
	q := prefetch.NewQueue(sourcetest.OpenStore(t), httpsource.New(nil), prefetch.WithResolveRetries(5, time.Hour))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(srv.URL()+"/missing/model.json", prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.ErrorIs(t, err, content.ErrPermanent)
	assert.Contains(t, st.Error, "404")
	assert.Equal(t, int64(1), srv.Requests())
}

func TestQueueSubmitInvalid(t *testing.T) {
	t.Parallel()
	q := prefetch.NewQueue(&fakeStore{}, &fakeSource{})
	_, err := q.Submit("https://user:pw@example.com/model.json", prefetch.PriorityNormal)
	assert.ErrorIs(t, err, ref.ErrInvalid)
	assert.Empty(t, q.Jobs())
}

// fakeSource resolves "https://x.example/<name>/model.json" to models[name].
type fakeSource struct {
	mu       sync.Mutex
	models   map[string]content.Model
	errs     []error // returned, in order, before resolving
	resolves int
}

func (s *fakeSource) Resolve(_ context.Context, r ref.Ref) (*source.Resolution, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.resolves++
	if len(s.errs) > 0 {
		err := s.errs[0]
		s.errs = s.errs[1:]
		return nil, err
	}
	name := strings.Split(r.URL.Path, "/")[1]
	m, ok := s.models[name]
	if !ok {
		return nil, content.Permanent(fmt.Errorf("no model %q", name))
	}
	res := &source.Resolution{Model: m, Blobs: make(map[digest.Digest]content.RangeOpener)}
	for _, f := range m.Files {
		res.Blobs[f.Digest] = nopOpener{}
	}
	return res, nil
}

type nopOpener struct{}

func (nopOpener) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return io.NopCloser(strings.NewReader("")), nil
}

// fakeStore records fetches; gate, when set, holds every Fetch until closed.
type fakeStore struct {
	gate     chan struct{}
	fail     map[digest.Digest]error
	inFlight atomic.Int32
	maxIn    atomic.Int32

	mu      sync.Mutex
	fetched []content.Descriptor
	held    map[digest.Digest]int
}

func (s *fakeStore) Open(d digest.Digest) (*os.File, error) {
	return nil, fmt.Errorf("open %s: %w", d, content.ErrNotFound)
}

func (s *fakeStore) Put(context.Context, io.Reader, int64) (cache.Info, error) {
	return cache.Info{}, errors.New("fakeStore: Put is not supported")
}

func (s *fakeStore) Hold(d digest.Digest) func() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held == nil {
		s.held = make(map[digest.Digest]int)
	}
	s.held[d]++
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.held[d]--; s.held[d] == 0 {
			delete(s.held, d)
		}
	}
}

func (s *fakeStore) Fetch(ctx context.Context, desc content.Descriptor, _ content.RangeOpener, progress content.Progress) (cache.Info, error) {
	n := s.inFlight.Add(1)
	defer s.inFlight.Add(-1)
	for {
		m := s.maxIn.Load()
		if n <= m || s.maxIn.CompareAndSwap(m, n) {
			break
		}
	}
	s.mu.Lock()
	s.fetched = append(s.fetched, desc)
	s.mu.Unlock()
	progress(desc.Size/2, desc.Size/5, desc.Size) // a fifth from peers
	if s.gate != nil {
		select {
		case <-s.gate:
		case <-ctx.Done():
			return cache.Info{}, ctx.Err()
		}
	}
	if err := s.fail[desc.Digest]; err != nil {
		return cache.Info{}, err
	}
	progress(desc.Size, 0, desc.Size)
	return cache.Info{Descriptor: desc}, nil
}

func (s *fakeStore) Materialize(m content.Model) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range m.Files {
		if s.held[f.Digest] == 0 {
			return "", fmt.Errorf("file %s was not held against eviction until materialised", f.Path)
		}
	}
	return "/models/" + m.Name + "/" + m.Revision, nil
}

// model builds a model of files with the given sizes; files share a blob
// when their sizes are equal.
func model(name string, sizes ...int64) content.Model {
	m := content.Model{Name: "org/" + name, Revision: "main"}
	for i, size := range sizes {
		d := digest.FromString(fmt.Sprintf("%s-%d", name, size))
		m.Files = append(m.Files, content.File{Path: fmt.Sprintf("f%d", i), Descriptor: content.Descriptor{Digest: d, Size: size}})
	}
	return m
}

func refFor(name string) string { return "https://x.example/" + name + "/model.json" }

func TestQueueFileConcurrencyAndOrder(t *testing.T) {
	t.Parallel()
	store := &fakeStore{gate: make(chan struct{})}
	src := &fakeSource{models: map[string]content.Model{"m": model("m", 10, 50, 30, 70, 20, 60, 40)}}
	q := prefetch.NewQueue(store, src, prefetch.WithFileConcurrency(3))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)

	require.Eventually(t, func() bool { return store.inFlight.Load() == 3 }, 5*time.Second, time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	assert.Equal(t, int32(3), store.maxIn.Load())
	st := j.Status()
	assert.Equal(t, prefetch.StateFetching, st.State)
	assert.Equal(t, int64(280), st.BytesTotal)
	assert.Equal(t, int64(35+30+25), st.BytesDone, "half of the three largest")
	assert.Equal(t, int64(14+12+10), st.BytesFromPeers, "a fifth of the three largest from peers")
	close(store.gate)

	st, err = sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Equal(t, "/models/org/m/main", st.Dir)
	assert.Equal(t, int64(280), st.BytesDone)
	var sizes []int64
	for _, d := range store.fetched {
		sizes = append(sizes, d.Size)
	}
	assert.ElementsMatch(t, []int64{70, 60, 50}, sizes[:3], "largest first")
	assert.ElementsMatch(t, []int64{70, 60, 50, 40, 30, 20, 10}, sizes)
}

func TestQueueLargestFirst(t *testing.T) {
	t.Parallel()
	store := &fakeStore{}
	src := &fakeSource{models: map[string]content.Model{"m": model("m", 10, 50, 30, 70, 20, 60, 40)}}
	q := prefetch.NewQueue(store, src, prefetch.WithFileConcurrency(1))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.NoError(t, err)
	var sizes []int64
	for _, d := range store.fetched {
		sizes = append(sizes, d.Size)
	}
	assert.Equal(t, []int64{70, 60, 50, 40, 30, 20, 10}, sizes)
	store.mu.Lock()
	assert.Empty(t, store.held, "holds are released when the job ends")
	store.mu.Unlock()
}

func TestQueueSharedBlobFetchedOnce(t *testing.T) {
	t.Parallel()
	store := &fakeStore{}
	src := &fakeSource{models: map[string]content.Model{"m": model("m", 10, 20, 10, 10)}}
	q := prefetch.NewQueue(store, src)
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Len(t, store.fetched, 2)
	assert.Equal(t, int64(30), st.BytesTotal)
	assert.Equal(t, int64(30), st.BytesDone)
	assert.Equal(t, 4, st.FilesTotal)
	assert.Equal(t, 4, st.FilesDone)
}

func TestQueueJobConcurrency(t *testing.T) {
	t.Parallel()
	store := &fakeStore{gate: make(chan struct{})}
	src := &fakeSource{models: map[string]content.Model{}}
	var jobs []*prefetch.Job
	reg := prometheus.NewRegistry()
	q := prefetch.NewQueue(store, src, prefetch.WithJobConcurrency(2), prefetch.WithFileConcurrency(1), prefetch.WithRegisterer(reg))
	for i := range 5 {
		name := fmt.Sprintf("m%d", i)
		src.models[name] = model(name, 10)
		j, err := q.Submit(refFor(name), prefetch.PriorityNormal)
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	sourcetest.RunQueue(t, q)
	require.Eventually(t, func() bool { return store.inFlight.Load() == 2 }, 5*time.Second, time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	assert.Equal(t, int32(2), store.maxIn.Load())
	var states []prefetch.JobState
	for _, st := range q.Jobs() {
		states = append(states, st.State)
	}
	assert.Equal(t, []prefetch.JobState{"fetching", "fetching", "queued", "queued", "queued"}, states, "FIFO")
	assert.InDelta(t, 3, metricValue(t, reg, "weightd_prefetch_queue_depth", ""), 0)

	close(store.gate)
	for _, j := range jobs {
		_, err := sourcetest.Wait(t, j)
		require.NoError(t, err)
	}
	assert.Equal(t, int32(2), store.maxIn.Load())
	assert.InDelta(t, 0, metricValue(t, reg, "weightd_prefetch_queue_depth", ""), 0)
}

func TestQueueResolveRetries(t *testing.T) {
	t.Parallel()
	transient := errors.New("connection reset")
	tests := []struct {
		name     string
		errs     []error
		attempts int
		ok       bool
		resolves int
	}{
		{"transient then ok", []error{transient, transient}, 3, true, 3},
		{"transient every time", []error{transient, transient, transient}, 3, false, 3},
		{"permanent", []error{content.Permanent(errors.New("404"))}, 3, false, 1},
		{"one attempt", []error{transient}, 1, false, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			src := &fakeSource{models: map[string]content.Model{"m": model("m", 10)}, errs: tt.errs}
			q := prefetch.NewQueue(&fakeStore{}, src, prefetch.WithResolveRetries(tt.attempts, time.Millisecond))
			sourcetest.RunQueue(t, q)
			j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
			require.NoError(t, err)
			st, err := sourcetest.Wait(t, j)
			assert.Equal(t, tt.ok, err == nil, "%v", err)
			assert.Equal(t, tt.ok, st.State == prefetch.StateReady)
			src.mu.Lock()
			assert.Equal(t, tt.resolves, src.resolves)
			src.mu.Unlock()
		})
	}
}

func TestQueueFetchFailure(t *testing.T) {
	t.Parallel()
	m := model("m", 10, 20)
	boom := content.Permanent(errors.New("boom"))
	store := &fakeStore{fail: map[digest.Digest]error{m.Files[1].Digest: boom}}
	q := prefetch.NewQueue(store, &fakeSource{models: map[string]content.Model{"m": m}})
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.ErrorIs(t, err, boom)
	assert.Equal(t, prefetch.StateFailed, st.State)
	assert.Equal(t, `fetching f1 (`+m.Files[1].Digest.String()+`): boom`, st.Error)
}

func TestQueueWatch(t *testing.T) {
	t.Parallel()
	store := &fakeStore{gate: make(chan struct{})}
	q := prefetch.NewQueue(store, &fakeSource{models: map[string]content.Model{"m": model("m", 10, 20, 30)}})
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)

	fast := j.Watch(t.Context())
	slow := j.Watch(t.Context()) // never read until the end
	ctx, cancel := context.WithCancel(t.Context())
	early := j.Watch(ctx)
	first := <-early
	assert.Equal(t, prefetch.StateQueued, first.State)
	cancel()
	require.Eventually(t, func() bool {
		_, ok := <-early
		return !ok
	}, 5*time.Second, time.Millisecond, "a cancelled watch is closed")

	sourcetest.RunQueue(t, q)
	var seen []prefetch.JobStatus
	gateClosed := false
	for st := range fast {
		seen = append(seen, st)
		if st.State == prefetch.StateFetching && !gateClosed {
			close(store.gate)
			gateClosed = true
		}
	}
	require.NotEmpty(t, seen)
	last := seen[len(seen)-1]
	assert.Equal(t, prefetch.StateReady, last.State)
	assert.Equal(t, int64(60), last.BytesDone)
	order := map[prefetch.JobState]int{"queued": 0, "resolving": 1, "fetching": 2, "ready": 3}
	for i := 1; i < len(seen); i++ {
		assert.LessOrEqual(t, order[seen[i-1].State], order[seen[i].State], "states only move forward")
		assert.LessOrEqual(t, seen[i-1].BytesDone, seen[i].BytesDone, "progress only grows")
	}

	// The slow watcher missed updates but gets the final one, then a close.
	<-j.Done()
	var slowSeen []prefetch.JobStatus
	for st := range slow {
		slowSeen = append(slowSeen, st)
	}
	require.Len(t, slowSeen, 1)
	assert.Equal(t, prefetch.StateReady, slowSeen[0].State)

	// Watching a finished job yields its final status and a close.
	var after []prefetch.JobStatus
	for st := range j.Watch(t.Context()) {
		after = append(after, st)
	}
	require.Len(t, after, 1)
	assert.Equal(t, last, after[0])
}

func TestQueueStop(t *testing.T) {
	t.Parallel()
	store := &fakeStore{gate: make(chan struct{})}
	src := &fakeSource{models: map[string]content.Model{"a": model("a", 1), "b": model("b", 1)}}
	q := prefetch.NewQueue(store, src, prefetch.WithJobConcurrency(1))
	running, err := q.Submit(refFor("a"), prefetch.PriorityNormal)
	require.NoError(t, err)
	queued, err := q.Submit(refFor("b"), prefetch.PriorityNormal)
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- q.Run(ctx) }()
	require.Eventually(t, func() bool { return running.Status().State == prefetch.StateFetching }, 5*time.Second, time.Millisecond)
	cancel()
	require.NoError(t, <-done)

	_, err = running.Wait(t.Context())
	assert.ErrorIs(t, err, context.Canceled)
	st, err := queued.Wait(t.Context())
	assert.ErrorIs(t, err, prefetch.ErrQueueStopped)
	assert.True(t, st.Started.IsZero(), "never started")

	_, err = q.Submit(refFor("a"), prefetch.PriorityNormal)
	assert.ErrorIs(t, err, prefetch.ErrQueueStopped)
	assert.Error(t, q.Run(t.Context()), "Run runs once")
}

func TestQueueHistory(t *testing.T) {
	t.Parallel()
	src := &fakeSource{models: map[string]content.Model{"a": model("a", 1), "b": model("b", 1), "c": model("c", 1)}}
	q := prefetch.NewQueue(&fakeStore{}, src, prefetch.WithHistory(2))
	sourcetest.RunQueue(t, q)
	var ids []string
	for _, name := range []string{"a", "b", "c"} {
		j, err := q.Submit(refFor(name), prefetch.PriorityNormal)
		require.NoError(t, err)
		_, err = sourcetest.Wait(t, j)
		require.NoError(t, err)
		ids = append(ids, j.ID())
	}
	_, ok := q.Job(ids[0])
	assert.False(t, ok, "the oldest finished job is forgotten")
	for _, id := range ids[1:] {
		_, ok := q.Job(id)
		assert.True(t, ok)
	}
	assert.Len(t, q.Jobs(), 2)
}

func TestQueueMetricsRegistration(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	q1 := prefetch.NewQueue(&fakeStore{}, &fakeSource{}, prefetch.WithRegisterer(reg))
	q2 := prefetch.NewQueue(&fakeStore{}, &fakeSource{}, prefetch.WithRegisterer(reg))
	sourcetest.RunQueue(t, q1)
	require.Eventually(t, func() bool {
		n, _ := testutil.GatherAndCount(reg, "weightd_prefetch_queue_depth")
		return n == 1
	}, 5*time.Second, time.Millisecond)
	err := q2.Run(t.Context())
	assert.ErrorContains(t, err, "registering prefetch metrics")
}

func TestJobStatusJSON(t *testing.T) {
	t.Parallel()
	created := time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)
	data, err := json.Marshal(prefetch.JobStatus{ID: "abc", Ref: "https://x/model.json", State: prefetch.StateQueued, Created: created})
	require.NoError(t, err)
	assert.JSONEq(t, `{"id":"abc","ref":"https://x/model.json","state":"queued","priority":"normal","bytesDone":0,"bytesTotal":0,
		"filesDone":0,"filesTotal":0,"created":"2025-01-02T03:04:05Z"}`, string(data))
	var back prefetch.JobStatus
	require.NoError(t, json.Unmarshal([]byte(`{"priority":"pod"}`), &back))
	assert.Equal(t, prefetch.PriorityPod, back.Priority)
	assert.Error(t, json.Unmarshal([]byte(`{"priority":"urgent"}`), &back))
	assert.True(t, prefetch.StateFailed.Finished())
	assert.False(t, prefetch.StateFetching.Finished())
}

// BenchmarkQueueIngest fetches a model from a local origin into a cold store
// through the queue: resolve, download, verify, commit, materialise.
func BenchmarkQueueIngest(b *testing.B) {
	for _, size := range []int64{64 << 20, 512 << 20} {
		for _, files := range []int{1, 4} {
			b.Run(fmt.Sprintf("%dMiB/files=%d", size>>20, files), func(b *testing.B) {
				dir := b.TempDir()
				spec := genmodel.Spec{Name: "org/bench", Files: files, TotalBytes: size, Seed: 1}
				m, err := genmodel.Generate(dir, spec)
				require.NoError(b, err)
				ln, err := net.Listen("tcp", "127.0.0.1:0")
				require.NoError(b, err)
				srv := genmodel.NewServer(ln, dir)
				ctx, cancel := context.WithCancel(b.Context())
				defer cancel()
				go srv.Run(ctx)

				b.SetBytes(m.TotalBytes())
				for b.Loop() {
					store, err := cache.Open(b.TempDir())
					require.NoError(b, err)
					q := prefetch.NewQueue(store, httpsource.New(nil))
					qctx, qcancel := context.WithCancel(ctx)
					done := make(chan error, 1)
					go func() { done <- q.Run(qctx) }()
					j, err := q.Submit(srv.URL()+"/"+genmodel.ManifestName, prefetch.PriorityNormal)
					require.NoError(b, err)
					_, err = j.Wait(ctx)
					require.NoError(b, err)
					qcancel()
					require.NoError(b, <-done)
					require.NoError(b, store.Close())
				}
				b.ReportMetric(float64(srv.BytesServed())/float64(b.N)/float64(m.TotalBytes()), "egress/size")
			})
		}
	}
}

// hasLabels reports whether the metric's labels are exactly want.
func hasLabels(labels []*dto.LabelPair, want map[string]string) bool {
	if len(labels) != len(want) {
		return false
	}
	for _, l := range labels {
		if want[l.GetName()] != l.GetValue() {
			return false
		}
	}
	return true
}
