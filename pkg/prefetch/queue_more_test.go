package prefetch_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

func TestQueuePriorities(t *testing.T) {
	t.Parallel()
	store := &fakeStore{gate: make(chan struct{})}
	models := map[string]content.Model{}
	for _, n := range []string{"busy", "bg", "normal1", "pod", "normal2", "raised"} {
		models[n] = model(n, 1)
	}
	q := prefetch.NewQueue(store, &fakeSource{models: models}, prefetch.WithJobConcurrency(1))
	busy, err := q.Submit(refFor("busy"), prefetch.PriorityNormal)
	require.NoError(t, err)
	sourcetest.RunQueue(t, q)
	require.Eventually(t, func() bool { return busy.Status().State == prefetch.StateFetching }, 5*time.Second, time.Millisecond)

	var jobs []*prefetch.Job
	for _, sub := range []struct {
		name string
		p    prefetch.Priority
	}{{"bg", prefetch.PriorityBackground}, {"normal1", prefetch.PriorityNormal}, {"raised", prefetch.PriorityBackground},
		{"pod", prefetch.PriorityPod}, {"normal2", prefetch.PriorityNormal}} {
		j, err := q.Submit(refFor(sub.name), sub.p)
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	// A pod now asks for what a policy queued: it joins the job and lifts it.
	again, err := q.Submit(refFor("raised"), prefetch.PriorityPod)
	require.NoError(t, err)
	assert.Same(t, jobs[2], again)
	assert.Equal(t, prefetch.PriorityPod, again.Status().Priority)

	close(store.gate)
	for _, j := range append(jobs, busy) {
		_, err := sourcetest.Wait(t, j)
		require.NoError(t, err)
	}
	// With one worker, jobs run one at a time in the order they start.
	assert.Equal(t, []string{"org/busy", "org/pod", "org/raised", "org/normal1", "org/normal2", "org/bg"}, startOrder(t, append(jobs, busy)))
}

// startOrder lists the jobs' models by the time they started.
func startOrder(t *testing.T, jobs []*prefetch.Job) []string {
	t.Helper()
	sts := make([]prefetch.JobStatus, len(jobs))
	for i, j := range jobs {
		sts[i] = j.Status()
	}
	slices.SortFunc(sts, func(a, b prefetch.JobStatus) int { return a.Started.Compare(b.Started) })
	out := make([]string, len(sts))
	for i, st := range sts {
		out[i] = st.Model
	}
	return out
}

func TestQueueCancel(t *testing.T) {
	t.Parallel()
	store := &fakeStore{gate: make(chan struct{})}
	src := &fakeSource{models: map[string]content.Model{"a": model("a", 1), "b": model("b", 1)}}
	q := prefetch.NewQueue(store, src, prefetch.WithJobConcurrency(1))
	sourcetest.RunQueue(t, q)
	running, err := q.Submit(refFor("a"), prefetch.PriorityNormal)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return running.Status().State == prefetch.StateFetching }, 5*time.Second, time.Millisecond)
	queued, err := q.Submit(refFor("b"), prefetch.PriorityNormal)
	require.NoError(t, err)

	require.True(t, q.Cancel(queued.ID()))
	st, err := sourcetest.Wait(t, queued)
	assert.ErrorIs(t, err, prefetch.ErrCanceled)
	assert.Equal(t, prefetch.StateFailed, st.State)
	assert.True(t, st.Started.IsZero())

	require.True(t, q.Cancel(running.ID()))
	_, err = sourcetest.Wait(t, running)
	assert.ErrorIs(t, err, prefetch.ErrCanceled)

	assert.False(t, q.Cancel("nope"))
	assert.True(t, q.Cancel(running.ID()), "cancelling a finished job is harmless")
	// A new submission after a cancel starts afresh.
	again, err := q.Submit(refFor("b"), prefetch.PriorityNormal)
	require.NoError(t, err)
	assert.NotEqual(t, queued.ID(), again.ID())
}

// imageSource resolves every reference to one image whose blobs it serves.
type imageSource struct{ res *source.Resolution }

func (s imageSource) Resolve(context.Context, ref.Ref) (*source.Resolution, error) {
	return s.res, nil
}

// fakeImporter records imports; the first failures imports fail.
type fakeImporter struct {
	store    *cache.Store
	failures int
	mu       sync.Mutex
	calls    int
	imported []string
}

func (f *fakeImporter) Import(_ context.Context, img *source.Image) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.calls <= f.failures {
		return errors.New("containerd restarting")
	}
	for _, b := range img.Blobs {
		if _, err := f.store.Stat(b.Digest); err != nil {
			return err
		}
	}
	f.imported = append(f.imported, img.Name)
	return nil
}

func imageResolution() *source.Resolution {
	res := &source.Resolution{Blobs: map[digest.Digest]content.RangeOpener{}, Model: content.Model{Name: "org/app", Revision: "v1"}}
	img := &source.Image{Name: "registry.example/org/app:v1"}
	for i, body := range []string{`{"manifest":1}`, `{"config":1}`, "layer-one", "layer-two"} {
		b := cache.Bytes(body)
		desc := content.Descriptor{Digest: digest.FromString(body), Size: int64(len(body))}
		res.Blobs[desc.Digest] = b
		img.Blobs = append(img.Blobs, source.ImageBlob{Descriptor: desc, MediaType: []string{"m", "c", "l", "l"}[i]})
	}
	img.Target = img.Blobs[0]
	res.Image = img
	return res
}

func TestQueueImportsImages(t *testing.T) {
	t.Parallel()
	store := sourcetest.OpenStore(t)
	imp := &fakeImporter{store: store, failures: 1}
	q := prefetch.NewQueue(store, imageSource{imageResolution()}, prefetch.WithImporter(imp), prefetch.WithResolveRetries(3, time.Millisecond))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit("oci://registry.example/org/app:v1", prefetch.PriorityPod)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Equal(t, prefetch.StateReady, st.State)
	assert.Equal(t, 4, len(store.List()), "every blob is in the cache")
	assert.Equal(t, []string{"registry.example/org/app:v1"}, imp.imported)
	assert.Equal(t, 2, imp.calls, "a failed import is retried")
	assert.Empty(t, st.Dir, "an image has no model directory")
	assert.Len(t, j.Blobs(), 4, "the job lists the blobs it fetched")
}

func TestQueueImportFailsPermanently(t *testing.T) {
	t.Parallel()
	store := sourcetest.OpenStore(t)
	imp := &fakeImporter{store: store, failures: 100}
	q := prefetch.NewQueue(store, imageSource{imageResolution()}, prefetch.WithImporter(imp), prefetch.WithResolveRetries(2, time.Millisecond))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit("oci://registry.example/org/app:v1", prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.ErrorContains(t, err, "containerd restarting")
	assert.Equal(t, prefetch.StateFailed, st.State)
	assert.Equal(t, 2, imp.calls)
}

func TestQueueUnpacksPackedLayers(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	files := map[string]string{"config.json": `{"a":1}`, "weights/model.safetensors": "tensor bytes"}
	for _, name := range []string{"config.json", "weights/model.safetensors"} {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(files[name])), Typeflag: tar.TypeReg}))
		_, err := tw.Write([]byte(files[name]))
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	layer := content.Descriptor{Digest: digest.FromBytes(buf.Bytes()), Size: int64(buf.Len())}
	raw := "raw file"
	rawDesc := content.Descriptor{Digest: digest.FromString(raw), Size: int64(len(raw))}
	res := &source.Resolution{
		Model:  content.Model{Name: "org/packed", Revision: "v1", Files: []content.File{{Path: "README.md", Descriptor: rawDesc}}},
		Blobs:  map[digest.Digest]content.RangeOpener{layer.Digest: cache.Bytes(buf.Bytes()), rawDesc.Digest: cache.Bytes(raw)},
		Packed: []source.PackedLayer{{Descriptor: layer, MediaType: "application/vnd.cnai.model.weight.v1.tar", Archive: true}},
	}
	store := sourcetest.OpenStore(t)
	q := prefetch.NewQueue(store, imageSource{res})
	sourcetest.RunQueue(t, q)
	j, err := q.Submit("oci://registry.example/org/packed:v1", prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err)
	files["README.md"] = raw
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(st.Dir, name))
		require.NoError(t, err, name)
		assert.Equal(t, want, string(got), name)
	}
}

// fakeStreaming is a StreamingImporter that records what the queue hands
// it. beginErr fails Begin; commitErr fails Commit (then Import succeeds).
type fakeStreaming struct {
	store     prefetch.Store
	beginErr  error
	commitErr error

	mu       sync.Mutex
	begun    int
	blobs    []digest.Digest
	commits  int
	aborts   int // Abort calls on an import not committed
	imports  int
	imported []string
}

func (f *fakeStreaming) Import(_ context.Context, img *source.Image) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.imports++
	f.imported = append(f.imported, img.Name)
	return nil
}

func (f *fakeStreaming) Begin(context.Context, *source.Image) (prefetch.ImageImport, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.beginErr != nil {
		return nil, f.beginErr
	}
	f.begun++
	return &fakeImageImport{f: f}, nil
}

type fakeImageImport struct {
	f     *fakeStreaming
	ended bool
}

func (i *fakeImageImport) Blob(_ context.Context, d digest.Digest) error {
	i.f.mu.Lock()
	defer i.f.mu.Unlock()
	if i.ended {
		return errors.New("Blob after the import ended")
	}
	if _, err := i.f.store.Open(d); err != nil {
		return fmt.Errorf("Blob(%s) before it is in the store: %w", d, err)
	}
	i.f.blobs = append(i.f.blobs, d)
	return nil
}

func (i *fakeImageImport) Commit(context.Context) error {
	i.f.mu.Lock()
	defer i.f.mu.Unlock()
	if i.ended {
		return errors.New("Commit after the import ended")
	}
	i.ended = true
	i.f.commits++
	return i.f.commitErr
}

func (i *fakeImageImport) Abort() {
	i.f.mu.Lock()
	defer i.f.mu.Unlock()
	if !i.ended {
		i.ended = true
		i.f.aborts++
	}
}

// streamedImage is an image of a manifest, a config and two layers of
// different sizes, the smaller listed first.
func streamedImage() (*source.Resolution, []digest.Digest) {
	res := &source.Resolution{Blobs: map[digest.Digest]content.RangeOpener{}, Model: content.Model{Name: "org/app", Revision: "v1"}}
	img := &source.Image{Name: "registry.example/org/app:v1"}
	var order []digest.Digest
	for _, b := range []struct{ mediaType, content string }{
		{"application/vnd.oci.image.manifest.v1+json", `{"manifest":"the largest of the documents, still smaller than a layer"}`},
		{"application/vnd.oci.image.config.v1+json", `{"config":1}`},
		{"application/vnd.oci.image.layer.v1.tar+gzip", strings.Repeat("small layer ", 100)},
		{"application/vnd.oci.image.layer.v1.tar+gzip", strings.Repeat("large layer ", 1000)},
	} {
		desc := content.Descriptor{Digest: digest.FromString(b.content), Size: int64(len(b.content))}
		res.Blobs[desc.Digest] = cache.Bytes(b.content)
		img.Blobs = append(img.Blobs, source.ImageBlob{Descriptor: desc, MediaType: b.mediaType})
		order = append(order, desc.Digest)
	}
	img.Target = img.Blobs[0]
	res.Image = img
	// Documents first, then the layers largest first.
	order[2], order[3] = order[3], order[2]
	return res, order
}

func TestQueueStreamsImageBlobs(t *testing.T) {
	t.Parallel()
	store := sourcetest.OpenStore(t)
	imp := &fakeStreaming{store: store}
	res, order := streamedImage()
	q := prefetch.NewQueue(store, imageSource{res}, prefetch.WithImporter(imp), prefetch.WithFileConcurrency(1))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit("oci://registry.example/org/app:v1", prefetch.PriorityPod)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Equal(t, prefetch.StateReady, st.State)

	imp.mu.Lock()
	defer imp.mu.Unlock()
	assert.Equal(t, 1, imp.begun)
	assert.Equal(t, order, imp.blobs, "each blob handed over once, as it lands: documents first")
	assert.Equal(t, 1, imp.commits)
	assert.Zero(t, imp.aborts, "Abort after Commit does nothing")
	assert.Zero(t, imp.imports, "no whole import")
}

func TestQueueStreamingAbortsOnFetchFailure(t *testing.T) {
	t.Parallel()
	res, order := streamedImage()
	boom := content.Permanent(errors.New("layer gone"))
	store := &fakeStore{fail: map[digest.Digest]error{order[3]: boom}}
	imp := &fakeStreaming{store: storeOpening{}} // the fake store holds nothing to open
	q := prefetch.NewQueue(store, imageSource{res}, prefetch.WithImporter(imp), prefetch.WithFileConcurrency(1))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit("oci://registry.example/org/app:v1", prefetch.PriorityPod)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.ErrorIs(t, err, boom)

	imp.mu.Lock()
	defer imp.mu.Unlock()
	assert.Equal(t, order[:3], imp.blobs, "the blobs fetched before the failure")
	assert.Zero(t, imp.commits)
	assert.Equal(t, 1, imp.aborts)
	assert.Zero(t, imp.imports)
}

// storeOpening opens every blob: for a fake store that holds none.
type storeOpening struct{ prefetch.Store }

func (storeOpening) Open(digest.Digest) (*os.File, error) { return os.Open(os.DevNull) }

func TestQueueStreamingFallsBackToWholeImports(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		imp  *fakeStreaming
	}{
		{"Begin fails", &fakeStreaming{beginErr: errors.New("containerd restarting")}},
		{"Commit fails", &fakeStreaming{commitErr: errors.New("containerd restarting")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store := sourcetest.OpenStore(t)
			imp := tc.imp
			imp.store = store
			res, _ := streamedImage()
			q := prefetch.NewQueue(store, imageSource{res}, prefetch.WithImporter(imp), prefetch.WithResolveRetries(3, time.Millisecond))
			sourcetest.RunQueue(t, q)
			j, err := q.Submit("oci://registry.example/org/app:v1", prefetch.PriorityPod)
			require.NoError(t, err)
			st, err := sourcetest.Wait(t, j)
			require.NoError(t, err)
			assert.Equal(t, prefetch.StateReady, st.State)
			imp.mu.Lock()
			defer imp.mu.Unlock()
			assert.Equal(t, []string{"registry.example/org/app:v1"}, imp.imported, "imported whole once")
			assert.Zero(t, imp.aborts)
		})
	}
}
