package containerd_test

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/cache"
	ctrimport "github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

// env is a containerd, a cache and an importer between them.
type env struct {
	ctd    *services.Containerd
	store  *cache.Store
	im     *ctrimport.Importer
	reg    *prometheus.Registry
	client *containerd.Client
}

func newEnv(t *testing.T) *env {
	t.Helper()
	return newEnvWith(t, ctrimport.Config{})
}

// newEnvWith is newEnv with an importer configured by cfg (its Address
// set here).
func newEnvWith(t *testing.T, cfg ctrimport.Config) *env {
	t.Helper()
	ctd := services.NewContainerdT(t, services.ContainerdConfig{})
	e := &env{ctd: ctd, store: openStore(t), reg: prometheus.NewRegistry()}
	var err error
	cfg.Address = ctd.Address
	e.im, err = ctrimport.New(cfg, e.store, ctrimport.WithRegisterer(e.reg))
	require.NoError(t, err)
	t.Cleanup(func() { e.im.Close() })
	e.client, err = containerd.New(ctd.Address, containerd.WithDefaultNamespace(ctd.Namespace))
	require.NoError(t, err)
	t.Cleanup(func() { e.client.Close() })
	return e
}

func (e *env) ctx(t *testing.T) context.Context {
	return namespaces.WithNamespace(t.Context(), e.ctd.Namespace)
}

// bytesWritten reads weightd_image_import_bytes_total.
func bytesWritten(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "weightd_image_import_bytes_total" {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no weightd_image_import_bytes_total")
	return 0
}

// imports counts weightd_image_import_seconds observations by outcome.
func imports(t *testing.T, reg *prometheus.Registry, outcome string) uint64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "weightd_image_import_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "outcome" && l.GetValue() == outcome {
					return m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	return 0
}

// requireImported checks that name is in containerd as the CRI would want
// it: a record pointing at target, unpacked for overlayfs (the top layer's
// chain ID is a committed snapshot), listed by ctr.
func (e *env) requireImported(t *testing.T, name string, target, config digest.Digest, diffIDs []digest.Digest) {
	t.Helper()
	ctx := e.ctx(t)
	rec, err := e.client.ImageService().Get(ctx, name)
	require.NoError(t, err)
	assert.Equal(t, target, rec.Target.Digest)
	assert.Equal(t, "managed", rec.Labels["io.cri-containerd.image"])
	img := containerd.NewImage(e.client, rec)
	ok, err := img.IsUnpacked(ctx, "overlayfs")
	require.NoError(t, err)
	assert.True(t, ok, "unpacked for overlayfs")
	chain := identity.ChainID(diffIDs).String()
	info, err := e.client.SnapshotService("overlayfs").Stat(ctx, chain)
	require.NoError(t, err, "the top layer's snapshot %s", chain)
	assert.Equal(t, "Committed", info.Kind.String())
	out, err := e.ctd.Ctr(t.Context(), "images", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, strings.Fields(string(out)), name)
	e.requireCRISees(t, name, target, config)
	out, err = e.ctd.Ctr(t.Context(), "images", "check")
	require.NoError(t, err)
	for line := range strings.SplitSeq(string(out), "\n") {
		if strings.HasPrefix(line, name+" ") {
			assert.Contains(t, line, "complete", line)
		}
	}
}

// requireCRISees waits until the CRI plugin (which learns of images from
// containerd's events) reports name as present with config as its ID.
func (e *env) requireCRISees(t *testing.T, name string, target, config digest.Digest) {
	t.Helper()
	var last *services.CRIImage
	require.Eventually(t, func() bool {
		img, err := services.ImageStatusCRI(t.Context(), e.ctd.Address, name)
		require.NoError(t, err)
		last = img
		return img != nil && img.ID == config.String()
	}, 5*time.Second, 20*time.Millisecond, "the CRI sees %s", name)
	if strings.Contains(name, "@") {
		assert.Contains(t, last.RepoDigests, name)
	} else {
		assert.Contains(t, last.RepoTags, name)
	}
	assert.NotZero(t, last.Size)
	// By digest too, as a pod may name it, once the name has a tag.
	if i := strings.LastIndexByte(name, ':'); i > strings.LastIndexByte(name, '/') && !strings.Contains(name, "@") {
		byDigest := name[:i] + "@" + target.String()
		img, err := services.ImageStatusCRI(t.Context(), e.ctd.Address, byDigest)
		require.NoError(t, err)
		require.NotNil(t, img, "the CRI sees %s", byDigest)
		assert.Equal(t, config.String(), img.ID)
		assert.Contains(t, last.RepoDigests, byDigest)
	}
}

func (e *env) requireNoRecord(t *testing.T, name string) {
	t.Helper()
	_, err := e.client.ImageService().Get(e.ctx(t), name)
	require.True(t, errdefs.IsNotFound(err), "no image record for %s: %v", name, err)
	// Just after containerd (re)starts, the CRI plugin may not serve yet.
	var img *services.CRIImage
	require.Eventually(t, func() bool {
		img, err = services.ImageStatusCRI(t.Context(), e.ctd.Address, name)
		return err == nil || !strings.Contains(err.Error(), "server is not initialized yet")
	}, 5*time.Second, 20*time.Millisecond)
	require.NoError(t, err)
	assert.Nil(t, img, "the CRI does not see %s", name)
}

func TestImport(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example:5000/team/app:v1", fixtureOpts{layers: 3, seed: 1})

	require.NoError(t, e.im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	// The cache and containerd are on one filesystem: every blob linked.
	e.requireLinked(t, fx.img)
	assert.Zero(t, bytesWritten(t, e.reg), "nothing written over gRPC")
	assert.EqualValues(t, 1, imports(t, e.reg, "ok"))

	// The labels containerd's GC follows, as a pull would set them.
	ctx := e.ctx(t)
	cs := e.client.ContentStore()
	mi, err := cs.Info(ctx, fx.img.Target.Digest)
	require.NoError(t, err)
	assert.Equal(t, fx.config.String(), mi.Labels["containerd.io/gc.ref.content.config"])
	for i, l := range fx.layers {
		assert.Equal(t, l.String(), mi.Labels["containerd.io/gc.ref.content.l."+string(rune('0'+i))])
	}
	li, err := cs.Info(ctx, fx.layers[0])
	require.NoError(t, err)
	assert.Equal(t, "team/app", li.Labels["containerd.io/distribution.source.registry.example"])
	ci, err := cs.Info(ctx, fx.config)
	require.NoError(t, err)
	assert.NotEmpty(t, ci.Labels["containerd.io/gc.ref.snapshot.overlayfs"], "unpack references the snapshot from the config")

	// A second import is a no-op: nothing written, quick.
	start := time.Now()
	require.NoError(t, e.im.Import(t.Context(), fx.img))
	assert.Less(t, time.Since(start), 2*time.Second)
	assert.Zero(t, bytesWritten(t, e.reg), "nothing written again")
	assert.EqualValues(t, 2, imports(t, e.reg, "ok"))

	// containerd's GC keeps the image's content and snapshots.
	e.gc(t)
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	for _, b := range fx.img.Blobs {
		_, err := cs.Info(ctx, b.Digest)
		require.NoError(t, err, "blob %s kept by the GC", b.Digest)
	}
}

// gc runs containerd's garbage collector now (deleting a lease
// synchronously does).
func (e *env) gc(t *testing.T) {
	t.Helper()
	ls := e.client.LeasesService()
	l, err := ls.Create(e.ctx(t), leases.WithRandomID())
	require.NoError(t, err)
	require.NoError(t, ls.Delete(e.ctx(t), l, leases.SynchronousDelete))
}

func TestImportUnpackFailsLeavesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:corrupt", fixtureOpts{layers: 2, seed: 13, badDiffID: true})
	err := e.im.Import(t.Context(), fx.img)
	require.Error(t, err)
	t.Logf("unpack error: %v", err)
	assert.Contains(t, err.Error(), "unpacking")
	assert.NotErrorIs(t, err, ctrimport.ErrUnreachable)
	e.requireNoRecord(t, fx.img.Name)

	// What the import wrote was held by its lease only: the GC takes it.
	e.gc(t)
	for _, b := range fx.img.Blobs {
		_, err := e.client.ContentStore().Info(e.ctx(t), b.Digest)
		assert.True(t, errdefs.IsNotFound(err), "blob %s collected: %v", b.Digest, err)
	}
}

func TestImportIndexOnlyNodePlatform(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/multi:latest", fixtureOpts{layers: 2, index: true, seed: 2})
	require.NoError(t, e.im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)

	// The index references the manifest present.
	ii, err := e.client.ContentStore().Info(e.ctx(t), fx.img.Target.Digest)
	require.NoError(t, err)
	assert.Equal(t, fx.img.Blobs[1].Digest.String(), ii.Labels["containerd.io/gc.ref.content.m.0"])
}

func TestImportNormalisesTheName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "busybox", fixtureOpts{layers: 1, seed: 3})
	require.NoError(t, e.im.Import(t.Context(), fx.img))
	e.requireImported(t, "docker.io/library/busybox:latest", fx.img.Target.Digest, fx.config, fx.diffIDs)
}

func TestImportContainerdDownThenRestarted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:down", fixtureOpts{layers: 2, seed: 4})

	// Connected once, then containerd goes away.
	other := newFixture(t, e.store, "registry.example/app:before", fixtureOpts{layers: 1, seed: 5})
	require.NoError(t, e.im.Import(t.Context(), other.img))
	e.ctd.Stop()

	err := e.im.Import(t.Context(), fx.img)
	require.Error(t, err)
	assert.ErrorIs(t, err, ctrimport.ErrUnreachable)
	assert.NotErrorIs(t, err, content.ErrPermanent, "worth retrying")
	assert.Contains(t, err.Error(), "containerd at "+e.ctd.Address+" unreachable")
	assert.EqualValues(t, 1, imports(t, e.reg, "error"))

	require.NoError(t, e.ctd.Start(t.Context()))
	e.requireNoRecord(t, fx.img.Name)
	require.NoError(t, e.im.Import(t.Context(), fx.img), "the importer reconnects")
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
}

func TestImportNeverConnected(t *testing.T) {
	t.Parallel()
	store := openStore(t)
	fx := newFixture(t, store, "registry.example/app:none", fixtureOpts{layers: 1, seed: 6})
	addr := filepath.Join(t.TempDir(), "no.sock")
	im, err := ctrimport.New(ctrimport.Config{Address: addr}, store)
	require.NoError(t, err)
	defer im.Close()
	err = im.Import(t.Context(), fx.img)
	require.ErrorIs(t, err, ctrimport.ErrUnreachable)
	assert.Contains(t, err.Error(), "containerd at "+addr+" unreachable")
}

func TestImportRestartMidImport(t *testing.T) {
	t.Parallel()
	// Blobs written over gRPC, so that an ingest is left to resume
	// (TestImportRestartMidLinkedImport has them linked).
	e := newEnvWith(t, ctrimport.Config{ContentRoot: ctrimport.ContentRootNone})
	fx := newFixture(t, e.store, "registry.example/app:big", fixtureOpts{layers: 1, bigLayer: 256 << 20, seed: 7})

	// Stop containerd as soon as it has part of the big layer in its ingest.
	ingest := filepath.Join(e.ctd.Root, "io.containerd.content.v1.content", "ingest")
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			datas, _ := filepath.Glob(filepath.Join(ingest, "*", "data"))
			for _, d := range datas {
				if fi, err := os.Stat(d); err == nil && fi.Size() > 0 {
					e.ctd.Stop()
					return
				}
			}
			time.Sleep(2 * time.Millisecond)
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
}

// missingOpener hides one blob of the cache.
type missingOpener struct {
	*cache.Store
	missing digest.Digest
}

func (m missingOpener) Open(d digest.Digest) (*os.File, error) {
	if d == m.missing {
		return nil, content.ErrNotFound
	}
	return m.Store.Open(d)
}

func TestImportBlobMissingFromCache(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:missing", fixtureOpts{layers: 3, seed: 8})
	im, err := ctrimport.New(ctrimport.Config{Address: e.ctd.Address}, missingOpener{e.store, fx.layers[1]})
	require.NoError(t, err)
	defer im.Close()

	err = im.Import(t.Context(), fx.img)
	require.Error(t, err)
	assert.ErrorIs(t, err, content.ErrNotFound)
	assert.Contains(t, err.Error(), fx.layers[1].String())
	assert.Contains(t, err.Error(), "not in the cache")
	e.requireNoRecord(t, fx.img.Name)
}

func TestImportInvalidImages(t *testing.T) {
	t.Parallel()
	store := openStore(t)
	// No containerd needed: these fail before connecting.
	im, err := ctrimport.New(ctrimport.Config{Address: filepath.Join(t.TempDir(), "unused.sock")}, store)
	require.NoError(t, err)
	defer im.Close()

	for _, tc := range []struct {
		name   string
		mutate func(*source.Image)
		want   string
	}{
		{"no name", func(i *source.Image) { i.Name = "" }, "image name"},
		{"bad name", func(i *source.Image) { i.Name = "UPPER/Case:tag" }, "image name"},
		{"layer not among the blobs", func(i *source.Image) { i.Blobs = i.Blobs[:len(i.Blobs)-1] }, "not among its blobs"},
		{"target not among the blobs", func(i *source.Image) { i.Blobs = i.Blobs[1:] }, "target"},
		{"bad digest", func(i *source.Image) { i.Blobs[1].Digest = "sha256:nothex" }, "blob"},
		{"no media type", func(i *source.Image) { i.Blobs[2].MediaType = "" }, "media type"},
		{"name's digest is not the target's", func(i *source.Image) { i.Name = "registry.example/app@" + i.Blobs[1].Digest.String() }, "digest"},
		{"target is a layer", func(i *source.Image) { i.Target = i.Blobs[2]; i.Blobs = i.Blobs[2:] }, "neither an index nor a manifest"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t, store, "registry.example/app:invalid", fixtureOpts{layers: 2, seed: 9})
			tc.mutate(fx.img)
			err := im.Import(t.Context(), fx.img)
			require.Error(t, err)
			assert.ErrorIs(t, err, content.ErrPermanent)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	require.Error(t, im.Import(t.Context(), nil))
}

func TestImportConcurrentSameName(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:concurrent", fixtureOpts{layers: 3, seed: 10})
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { errs[i] = e.im.Import(t.Context(), fx.img) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
	e.requireLinked(t, fx.img)
	assert.Zero(t, bytesWritten(t, e.reg), "each blob linked, none written")
}

func TestImportRetagUpdatesRecord(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a := newFixture(t, e.store, "registry.example/app:moving", fixtureOpts{layers: 1, seed: 11})
	b := newFixture(t, e.store, "registry.example/app:moving", fixtureOpts{layers: 2, seed: 12})
	require.NoError(t, e.im.Import(t.Context(), a.img))
	require.NoError(t, e.im.Import(t.Context(), b.img))
	e.requireImported(t, b.img.Name, b.img.Target.Digest, b.config, b.diffIDs)
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	_, err := ctrimport.New(ctrimport.Config{Platform: "not a platform!"}, openStore(t))
	require.ErrorIs(t, err, ctrimport.ErrInvalidConfig)
	_, err = ctrimport.New(ctrimport.Config{}, nil)
	require.ErrorIs(t, err, ctrimport.ErrInvalidConfig)
	im, err := ctrimport.New(ctrimport.Config{}, openStore(t))
	require.NoError(t, err)
	c := im.Config()
	assert.Equal(t, "/run/containerd/containerd.sock", c.Address)
	assert.Equal(t, "k8s.io", c.Namespace)
	assert.Equal(t, "overlayfs", c.Snapshotter)
	assert.NotEmpty(t, c.Platform)
}

// TestImportPushedImage imports an image as weightd gets it from a
// registry (Docker media types, gzip layers written by go-containerregistry)
// and checks containerd ends up as a pull would leave it.
func TestImportPushedImage(t *testing.T) {
	t.Parallel()
	services.RequireRegistry(t)
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	e := newEnv(t)
	pushed, err := services.PushRandomImage(t.Context(), reg.Addr, "team/pushed", "v2", 3, 256<<10, nil)
	require.NoError(t, err)

	// Fetch its blobs into the cache, as weightd would.
	ref, err := name.ParseReference(pushed.Ref, name.Insecure)
	require.NoError(t, err)
	desc, err := remote.Get(ref, remote.WithContext(t.Context()))
	require.NoError(t, err)
	rimg, err := desc.Image()
	require.NoError(t, err)
	mt := string(desc.MediaType)
	img := &source.Image{Name: pushed.Ref}
	img.Target = put(t, e.store, mt, desc.Manifest)
	img.Blobs = append(img.Blobs, img.Target)
	m, err := rimg.Manifest()
	require.NoError(t, err)
	rawCfg, err := rimg.RawConfigFile()
	require.NoError(t, err)
	cfg := put(t, e.store, string(m.Config.MediaType), rawCfg)
	img.Blobs = append(img.Blobs, cfg)
	layers, err := rimg.Layers()
	require.NoError(t, err)
	var diffIDs []digest.Digest
	for i, l := range layers {
		rc, err := l.Compressed()
		require.NoError(t, err)
		b, err := io.ReadAll(rc)
		require.NoError(t, err)
		rc.Close()
		img.Blobs = append(img.Blobs, put(t, e.store, string(m.Layers[i].MediaType), b))
		d, err := l.DiffID()
		require.NoError(t, err)
		diffIDs = append(diffIDs, digest.Digest(d.String()))
	}
	require.Equal(t, pushed.Digest, img.Target.Digest)

	served := reg.BytesServed()
	require.NoError(t, e.im.Import(t.Context(), img))
	assert.Equal(t, served, reg.BytesServed(), "the import reads nothing from the registry")
	e.requireImported(t, pushed.Ref, pushed.Digest, cfg.Digest, diffIDs)

	// A pull of the same image by containerd finds everything present.
	out, err := e.ctd.Ctr(t.Context(), "images", "pull", "--plain-http", pushed.Ref)
	require.NoError(t, err, "%s", out)
	assert.Less(t, reg.BytesServed()-served, int64(64<<10), "only the manifest is fetched again")
}

func TestImportByDigest(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t, e.store, "registry.example/app:ignored", fixtureOpts{layers: 1, seed: 14})
	fx.img.Name = "registry.example/app@" + fx.img.Target.Digest.String()
	require.NoError(t, e.im.Import(t.Context(), fx.img))
	e.requireImported(t, fx.img.Name, fx.img.Target.Digest, fx.config, fx.diffIDs)
}
