package containerd_test

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	ctrimport "github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

// arrivingStore is a cache whose blobs arrive one by one: Open finds a blob
// only once the test has released it.
type arrivingStore struct {
	*cache.Store
	mu       sync.Mutex
	released map[digest.Digest]bool
}

func newArrivingStore(s *cache.Store) *arrivingStore {
	return &arrivingStore{Store: s, released: map[digest.Digest]bool{}}
}

func (a *arrivingStore) release(d digest.Digest) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.released[d] = true
}

func (a *arrivingStore) Open(d digest.Digest) (*os.File, error) {
	a.mu.Lock()
	ok := a.released[d]
	a.mu.Unlock()
	if !ok {
		return nil, content.ErrNotFound
	}
	return a.Store.Open(d)
}

// streamingImporter is an importer reading from opener into e's containerd.
func (e *env) streamingImporter(t *testing.T, opener ctrimport.BlobOpener) *ctrimport.Importer {
	t.Helper()
	im, err := ctrimport.New(ctrimport.Config{Address: e.ctd.Address}, opener)
	require.NoError(t, err)
	t.Cleanup(func() { im.Close() })
	return im
}

// snapshotExists says whether the overlayfs snapshot key is committed.
func (e *env) snapshotExists(t *testing.T, key string) bool {
	t.Helper()
	info, err := e.client.SnapshotService("overlayfs").Stat(e.ctx(t), key)
	if errdefs.IsNotFound(err) {
		return false
	}
	require.NoError(t, err)
	return info.Kind == snapshots.KindCommitted
}

// requireCollected runs the GC and checks that none of img's blobs and no
// snapshot are left.
func (e *env) requireCollected(t *testing.T, img *source.Image) {
	t.Helper()
	e.gc(t)
	for _, b := range img.Blobs {
		_, err := e.client.ContentStore().Info(e.ctx(t), b.Digest)
		assert.True(t, errdefs.IsNotFound(err), "blob %s collected: %v", b.Digest, err)
	}
	var left []string
	require.NoError(t, e.client.SnapshotService("overlayfs").Walk(e.ctx(t), func(_ context.Context, info snapshots.Info) error {
		left = append(left, info.Name)
		return nil
	}))
	assert.Empty(t, left, "snapshots collected")
}

// TestStreamingImport hands an image's blobs over one by one, as the queue
// does while it fetches them: each layer is unpacked as soon as it and the
// layers below it are handed over, long before Commit, which then creates
// the records.
func TestStreamingImport(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:streamed", fixtureOpts{layers: 3, index: true, seed: 21})
	arriving := newArrivingStore(e.store)
	im := e.streamingImporter(t, arriving)

	imp, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	defer imp.Abort()
	hand := func(d digest.Digest) {
		t.Helper()
		arriving.release(d)
		require.NoError(t, imp.Blob(t.Context(), d))
	}
	// The documents first, as the queue fetches them: index, manifest,
	// config.
	for _, b := range fx.img.Blobs[:3] {
		hand(b.Digest)
	}
	// The layers out of order: the second layer waits for the first.
	hand(fx.layers[1])
	time.Sleep(200 * time.Millisecond)
	assert.False(t, e.snapshotExists(t, identity.ChainID(fx.diffIDs[:2]).String()), "layer 1 is not unpacked before layer 0")
	hand(fx.layers[0])
	require.Eventually(t, func() bool {
		return e.snapshotExists(t, identity.ChainID(fx.diffIDs[:2]).String())
	}, 10*time.Second, 10*time.Millisecond, "layers 0 and 1 unpacked once handed over, before Commit")
	e.requireNoRecord(t, fx.img.Name)

	hand(fx.layers[2])
	require.NoError(t, imp.Commit(t.Context()))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	require.Error(t, imp.Commit(t.Context()), "an import commits once")
	require.Error(t, imp.Blob(t.Context(), fx.layers[0]), "no blobs after Commit")
	imp.Abort() // does nothing now
	e.gc(t)
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)

	// No lease is left behind.
	ls, err := e.client.LeasesService().List(e.ctx(t))
	require.NoError(t, err)
	assert.Empty(t, ls)
}

// TestStreamingImportLayersFirst hands the layers over before the documents
// that say what they are: they are written meanwhile and unpacked once the
// manifest and config arrive; Commit takes the blobs never handed over from
// the store.
func TestStreamingImportLayersFirst(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:layers-first", fixtureOpts{layers: 2, seed: 22})
	im := e.streamingImporter(t, e.store)
	imp, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	defer imp.Abort()
	for _, l := range fx.layers {
		require.NoError(t, imp.Blob(t.Context(), l))
	}
	require.NoError(t, imp.Blob(t.Context(), fx.img.Target.Digest))
	require.NoError(t, imp.Commit(t.Context())) // the config was never handed over
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
}

func TestStreamingImportAbort(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:aborted", fixtureOpts{layers: 3, seed: 23})
	im := e.streamingImporter(t, e.store)
	imp, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	for _, b := range fx.img.Blobs[:4] { // manifest, config, two layers
		require.NoError(t, imp.Blob(t.Context(), b.Digest))
	}
	require.Eventually(t, func() bool {
		return e.snapshotExists(t, identity.ChainID(fx.diffIDs[:2]).String())
	}, 10*time.Second, 10*time.Millisecond, "two layers unpacked")
	imp.Abort()
	require.Error(t, imp.Commit(t.Context()), "no Commit after Abort")
	e.requireNoRecord(t, fx.img.Name)
	e.requireCollected(t, fx.img)

	// A later import of the same name is not held up.
	require.NoError(t, im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
}

// TestStreamingImportBlobMissing commits an import one of whose layers
// never reached the cache: no record, and the GC takes what was written and
// unpacked.
func TestStreamingImportBlobMissing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:stream-missing", fixtureOpts{layers: 3, seed: 24})
	arriving := newArrivingStore(e.store)
	im := e.streamingImporter(t, arriving)
	imp, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	defer imp.Abort()
	for _, b := range fx.img.Blobs {
		if b.Digest == fx.layers[2] {
			require.Error(t, imp.Blob(t.Context(), b.Digest), "Blob of a blob not in the store")
			continue
		}
		arriving.release(b.Digest)
		_ = imp.Blob(t.Context(), b.Digest) // after the failure: its error
	}
	err = imp.Commit(t.Context())
	require.ErrorIs(t, err, content.ErrNotFound)
	assert.Contains(t, err.Error(), fx.layers[2].String())
	assert.NotErrorIs(t, err, content.ErrPermanent, "worth retrying")
	e.requireNoRecord(t, fx.img.Name)
	e.requireCollected(t, fx.img)
}

// TestStreamingImportContainerdStops stops containerd while the blobs
// arrive: the import fails as unreachable and leaves no record; what it
// wrote is held only by its lease (which it could not delete, containerd
// being down; it expires), so the GC takes it once the lease is gone.
func TestStreamingImportContainerdStops(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:stream-down", fixtureOpts{layers: 3, seed: 25})
	im := e.streamingImporter(t, e.store)
	imp, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	defer imp.Abort()
	for _, b := range fx.img.Blobs[:3] { // manifest, config, the first layer
		require.NoError(t, imp.Blob(t.Context(), b.Digest))
	}
	require.Eventually(t, func() bool {
		return e.snapshotExists(t, identity.ChainID(fx.diffIDs[:1]).String())
	}, 10*time.Second, 10*time.Millisecond, "the first layer unpacked")
	e.ctd.Stop()
	for _, b := range fx.img.Blobs[3:] {
		_ = imp.Blob(t.Context(), b.Digest) // fails once the write fails
	}
	err = imp.Commit(t.Context())
	require.Error(t, err)
	t.Logf("error: %v", err)
	assert.ErrorIs(t, err, ctrimport.ErrUnreachable)

	require.NoError(t, e.ctd.Start(t.Context()))
	e.requireNoRecord(t, fx.img.Name)
	ls := e.client.LeasesService()
	held, err := ls.List(e.ctx(t))
	require.NoError(t, err)
	require.Len(t, held, 1, "the import's lease, with its expiry")
	assert.NotEmpty(t, held[0].Labels["containerd.io/gc.expire"])
	require.NoError(t, ls.Delete(e.ctx(t), leases.Lease{ID: held[0].ID}, leases.SynchronousDelete))
	e.requireCollected(t, fx.img)

	// Retried, it imports.
	require.NoError(t, im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
}

// TestStreamingBeginWhileImporting begins an import of a name another
// import holds: Begin fails at once (the caller imports whole later)
// rather than hold up the caller's downloads.
func TestStreamingBeginWhileImporting(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:twice", fixtureOpts{layers: 1, seed: 26})
	im := e.streamingImporter(t, e.store)
	first, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	_, err = im.Begin(t.Context(), fx.img)
	require.ErrorContains(t, err, "under way")
	assert.NotErrorIs(t, err, content.ErrPermanent)
	first.Abort()

	second, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	require.NoError(t, second.Commit(t.Context()))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
}
