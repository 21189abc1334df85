package containerd_test

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	ctrimport "github.com/weightd/weightd/pkg/containerd"
	wcontent "github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

// contentBlob is where containerd's content store keeps blob d.
func (e *env) contentBlob(d digest.Digest) string {
	return filepath.Join(e.ctd.Root, "io.containerd.content.v1.content", "blobs", d.Algorithm().String(), d.Encoded())
}

// requireLinked checks that each of img's blobs in containerd is the
// cache's file, not a copy.
func (e *env) requireLinked(t *testing.T, img *source.Image) {
	t.Helper()
	e.requireShared(t, img, true)
}

// requireCopied checks that each of img's blobs in containerd is a file of
// its own, written once over gRPC.
func (e *env) requireCopied(t *testing.T, img *source.Image) {
	t.Helper()
	var total int64
	for _, b := range img.Blobs {
		total += b.Size
	}
	e.requireShared(t, img, false)
	assert.Equal(t, float64(total), bytesWritten(t, e.reg), "every blob written once")
}

// requireShared checks whether each of img's blobs in containerd is the
// cache's file (linked) or not.
func (e *env) requireShared(t *testing.T, img *source.Image, linked bool) {
	t.Helper()
	for _, b := range img.Blobs {
		p, err := e.store.BlobPath(b.Digest)
		require.NoError(t, err)
		inCache, err := os.Stat(p)
		require.NoError(t, err)
		inContainerd, err := os.Stat(e.contentBlob(b.Digest))
		require.NoError(t, err, "blob %s in containerd's content store", b.Digest)
		assert.Equal(t, linked, os.SameFile(inCache, inContainerd), "blob %s in containerd is the cache's file: want %v", b.Digest, linked)
	}
}

// TestImportLinkedOutlivesEitherSide: a linked blob is one file with two
// names; containerd's GC removes its name, the cache's stays and is intact.
func TestImportLinkedOutlivesEitherSide(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:linked", fixtureOpts{layers: 2, bigLayer: 4 << 20, seed: 21})
	require.NoError(t, e.im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	e.requireLinked(t, fx.img)

	// containerd reads the linked content as its own, and a container's
	// root filesystem from the image holds the layers' files.
	ctx := e.ctx(t)
	for _, b := range fx.img.Blobs {
		ra, err := e.client.ContentStore().ReaderAt(ctx, ocispec.Descriptor{Digest: b.Digest, Size: b.Size})
		require.NoError(t, err)
		v := b.Digest.Verifier()
		_, err = io.Copy(v, content.NewReader(ra))
		ra.Close()
		require.NoError(t, err)
		assert.True(t, v.Verified(), "containerd reads %s", b.Digest)
	}
	sn := e.client.SnapshotService("overlayfs")
	mounts, err := sn.View(ctx, "linked-view", identity.ChainID(fx.diffIDs).String())
	require.NoError(t, err)
	t.Cleanup(func() { _ = sn.Remove(e.ctx(t), "linked-view") })
	require.NoError(t, mount.WithReadonlyTempMount(ctx, mounts, func(root string) error {
		for _, dir := range []string{"layer2100", "layer2101"} {
			if _, err := os.Stat(filepath.Join(root, dir, "file0")); err != nil {
				return err
			}
		}
		fi, err := os.Stat(filepath.Join(root, "big.bin"))
		if err == nil && fi.Size() != 4<<20 {
			err = fmt.Errorf("big.bin is %d bytes", fi.Size())
		}
		return err
	}))
	require.NoError(t, sn.Remove(ctx, "linked-view"))

	// Remove every record (the CRI adds its own), then collect.
	out, err := e.ctd.Ctr(t.Context(), "images", "ls", "-q")
	require.NoError(t, err)
	for _, name := range strings.Fields(string(out)) {
		require.NoError(t, e.client.ImageService().Delete(e.ctx(t), name))
	}
	e.requireCollected(t, fx.img)
	for _, b := range fx.img.Blobs {
		_, err := os.Lstat(e.contentBlob(b.Digest))
		assert.ErrorIs(t, err, os.ErrNotExist, "containerd's name for %s removed", b.Digest)
		f, err := e.store.Open(b.Digest)
		require.NoError(t, err, "the cache keeps %s", b.Digest)
		v := b.Digest.Verifier()
		_, err = f.WriteTo(v)
		f.Close()
		require.NoError(t, err)
		assert.True(t, v.Verified(), "the cache's %s intact", b.Digest)
	}

	// Imported again, linked again.
	require.NoError(t, e.im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	e.requireLinked(t, fx.img)
	assert.Zero(t, bytesWritten(t, e.reg))
}

// TestImportLinkRefusedWrites: wherever a link cannot be made the blobs are
// written over gRPC, and the image is imported all the same.
func TestImportLinkRefusedWrites(t *testing.T) {
	t.Parallel()
	otherFS := func(t *testing.T) string {
		dir, err := os.MkdirTemp("/dev/shm", "ctrd-content")
		if err != nil {
			t.Skipf("no /dev/shm: %v", err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		var shm, tmp syscall.Stat_t
		require.NoError(t, syscall.Stat(dir, &shm))
		require.NoError(t, syscall.Stat(t.TempDir(), &tmp))
		if shm.Dev == tmp.Dev {
			t.Skip("/dev/shm is on the cache's filesystem")
		}
		require.NoError(t, os.Mkdir(filepath.Join(dir, "ingest"), 0o755))
		return dir
	}
	for _, tc := range []struct {
		name string
		root func(t *testing.T) string
	}{
		{"linking off", func(*testing.T) string { return ctrimport.ContentRootNone }},
		{"another filesystem", otherFS},
		{"missing here", func(t *testing.T) string { return filepath.Join(t.TempDir(), "not-mounted") }},
		{"not a content store", func(t *testing.T) string { return t.TempDir() }},
		{"blobs not a directory", func(t *testing.T) string {
			dir := t.TempDir()
			require.NoError(t, os.Mkdir(filepath.Join(dir, "ingest"), 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "blobs"), nil, 0o444))
			return dir
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			root := tc.root(t)
			e := newEnvWith(t, ctrimport.Config{ContentRoot: root})
			fx := newFixture(t, e.store, "registry.example/app:written", fixtureOpts{layers: 3, seed: 22})
			require.NoError(t, e.im.Import(t.Context(), fx.img))
			e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
			e.requireCopied(t, fx.img)
			if root != ctrimport.ContentRootNone {
				entries, _ := os.ReadDir(filepath.Join(root, "blobs", "sha256"))
				assert.Empty(t, entries, "nothing linked into %s", root)
			}
		})
	}
}

// TestImportCorruptCacheBlobNotLinked: a blob whose bytes in the cache no
// longer match its digest is never linked into containerd, which would
// trust it: the import fails and leaves nothing behind.
func TestImportCorruptCacheBlobNotLinked(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:rotten", fixtureOpts{layers: 2, seed: 23})
	bad := fx.layers[1]
	p, err := e.store.BlobPath(bad)
	require.NoError(t, err)
	require.NoError(t, os.Chmod(p, 0o644))
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteAt([]byte{0xff, 0xff, 0xff, 0xff}, 10)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	require.NoError(t, os.Chmod(p, 0o444))

	err = e.im.Import(t.Context(), fx.img)
	require.Error(t, err)
	assert.ErrorIs(t, err, wcontent.ErrDigestMismatch)
	assert.NotErrorIs(t, err, ctrimport.ErrUnreachable)
	e.requireNoRecord(t, fx.img.Name)
	_, err = os.Lstat(e.contentBlob(bad))
	assert.ErrorIs(t, err, os.ErrNotExist, "the corrupt blob is not in containerd's content store")
	e.requireCollected(t, fx.img)
}

// TestStreamingImportLinks: blobs handed over one by one as they arrive are
// linked too.
func TestStreamingImportLinks(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:arriving-linked", fixtureOpts{layers: 3, seed: 24})
	as := newArrivingStore(e.store)
	im := e.streamingImporter(t, as)
	ii, err := im.Begin(t.Context(), fx.img)
	require.NoError(t, err)
	for i := len(fx.img.Blobs) - 1; i >= 0; i-- { // layers first, the manifest last
		d := fx.img.Blobs[i].Digest
		as.release(d)
		require.NoError(t, ii.Blob(t.Context(), d))
	}
	require.NoError(t, ii.Commit(t.Context()))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	e.requireLinked(t, fx.img)
}

// TestImportRestartMidLinkedImport: containerd stops once the big layer is
// linked, before the import is done; the import fails as unreachable,
// leaves no record, and the retry after the restart completes it.
func TestImportRestartMidLinkedImport(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:big-linked", fixtureOpts{layers: 1, bigLayer: 256 << 20, seed: 25})
	big := fx.layers[len(fx.layers)-1]
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			if _, err := os.Lstat(e.contentBlob(big)); err == nil {
				e.ctd.Stop()
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	err := e.im.Import(t.Context(), fx.img)
	<-stopped
	require.Error(t, err, "containerd stopped mid-import")
	t.Logf("mid-import error: %v", err)
	assert.ErrorIs(t, err, ctrimport.ErrUnreachable)

	require.NoError(t, e.ctd.Start(t.Context()))
	e.requireNoRecord(t, fx.img.Name)
	require.NoError(t, e.im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	e.requireLinked(t, fx.img)
}
