package containerd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/rootfs"
	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/identity"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/weightd/weightd/pkg/prefetch"
)

var _ prefetch.StreamingImporter = (*Importer)(nil)

// errAborted is the cause of an import's context once Abort was called.
var errAborted = errors.New("image import aborted")

// imageImport is one image's import under way: blobs are written into
// containerd as they are handed over, the layers unpacked in order as soon
// as they are written, and the records created by Commit. Everything it
// writes or unpacks is held by one lease until the records exist.
//
// Threading: Blob, Commit and Abort may be called from any goroutine; the
// writers and the unpacker run in goroutines of their own that end before
// Commit or Abort returns.
type imageImport struct {
	im    *Importer
	c     *containerd.Client
	start time.Time

	// ctx is namespaced and leased; cancel ends the writers and the
	// unpacker.
	ctx          context.Context
	cancel       context.CancelCauseFunc
	releaseLease func(context.Context) error
	unlock       func()

	sem     chan struct{}  // a token per blob being written
	workers sync.WaitGroup // writers and the unpacker

	// laidOut is closed once the plan's layout is complete.
	laidOut chan struct{}
	// stored has, per blob, a channel closed once it is in containerd.
	stored map[digest.Digest]chan struct{}
	// unpacked is closed when the unpacker ends.
	unpacked chan struct{}

	mu      sync.Mutex // guards what follows, and p
	p       *plan
	handed  map[digest.Digest]bool
	err     error // the first failure
	written int64 // bytes written over gRPC
	linked  int64 // bytes hard-linked
	closing bool  // Commit or Abort called: no more blobs
	ended   bool  // committed or aborted
}

// begin takes the name's lock (waiting for it, or failing at once unless
// wait), connects, takes a lease and starts the unpacker. It takes p
// (closing it on error).
func (im *Importer) begin(ctx context.Context, p *plan, start time.Time, wait bool) (_ *imageImport, err error) {
	ii := &imageImport{
		im:       im,
		start:    start,
		sem:      make(chan struct{}, im.cfg.Concurrency),
		laidOut:  make(chan struct{}),
		stored:   make(map[digest.Digest]chan struct{}, len(p.blobs)),
		unpacked: make(chan struct{}),
		p:        p,
		handed:   make(map[digest.Digest]bool, len(p.blobs)),
	}
	defer func() {
		if err != nil {
			p.close()
			im.observe(p.name, start, 0, 0, err)
		}
	}()
	for _, b := range p.blobs {
		ii.stored[b.desc.Digest] = make(chan struct{})
	}
	unlock, err := im.lockName(ctx, p.name, wait)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", p.name, err)
	}
	defer func() {
		if err != nil {
			unlock()
		}
	}()
	c, err := im.connect(ctx)
	if err != nil {
		return nil, err
	}
	ctx = namespaces.WithNamespace(ctx, im.cfg.Namespace)
	// The lease holds what the import writes and unpacks until the records
	// reference it; should this process die, it expires.
	lctx, done, err := c.WithLease(ctx, leases.WithRandomID(), leases.WithExpiration(leaseExpiry))
	if err != nil {
		return nil, im.wrap(c, "creating a lease", err)
	}
	ii.c, ii.unlock, ii.releaseLease = c, unlock, done
	ii.ctx, ii.cancel = context.WithCancelCause(lctx)
	if p.ready {
		close(ii.laidOut)
	}
	ii.workers.Go(ii.unpack)
	return ii, nil
}

// Blob tells the import that blob d is complete in the cache. It opens it
// and, unless it is a manifest or an index (written by Commit, after what
// they reference), starts writing it into containerd; it does not wait for
// the write. It returns the import's first failure, if any.
func (ii *imageImport) Blob(ctx context.Context, d digest.Digest) error {
	ii.mu.Lock()
	defer ii.mu.Unlock()
	if ii.closing {
		return errors.New("image import ended")
	}
	if ii.err != nil {
		return ii.err
	}
	b, ok := ii.p.byDigest[d]
	if !ok {
		return fmt.Errorf("image %s: %s is not one of its blobs", ii.p.name, d)
	}
	if err := ii.p.open(b, ii.im.blobs); err != nil {
		ii.failLocked(err)
		return err
	}
	return ii.handLocked(b)
}

// handLocked works the open blob b into the layout and starts writing it.
// ii.mu is held.
func (ii *imageImport) handLocked(b *planBlob) error {
	if ii.handed[b.desc.Digest] {
		return nil
	}
	ii.handed[b.desc.Digest] = true
	if !ii.p.ready {
		ready, err := ii.p.layout()
		if err != nil {
			ii.failLocked(err)
			return err
		}
		if ready {
			close(ii.laidOut)
		}
	}
	if !b.parent {
		ii.workers.Go(func() { ii.write(b) })
	}
	return nil
}

// write writes one blob, once a writer's token is free.
func (ii *imageImport) write(b *planBlob) {
	select {
	case ii.sem <- struct{}{}:
	case <-ii.ctx.Done():
		return
	}
	defer func() { <-ii.sem }()
	n, linked, err := ii.im.writeBlob(ii.ctx, ii.c, ii.c.ContentStore(), ii.p.name, b)
	ii.im.m.bytes.Add(float64(n))
	ii.mu.Lock()
	ii.written += n
	ii.linked += linked
	ii.mu.Unlock()
	if err != nil {
		ii.fail(err)
		return
	}
	close(ii.stored[b.desc.Digest])
}

// fail records the import's first failure and stops its workers.
func (ii *imageImport) fail(err error) {
	ii.mu.Lock()
	defer ii.mu.Unlock()
	ii.failLocked(err)
}

func (ii *imageImport) failLocked(err error) {
	if ii.err == nil {
		ii.err = err
		ii.cancel(err)
	}
}

// waitFor waits for ch to close, or the import to fail.
func (ii *imageImport) waitFor(ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ii.ctx.Done():
		return context.Cause(ii.ctx)
	}
}

// unpack applies the layers to the snapshotter one by one, each as soon as
// it is in containerd, as containerd's client does (rootfs.ApplyLayer),
// then has the config reference the top snapshot for the GC.
func (ii *imageImport) unpack() {
	defer close(ii.unpacked)
	if err := ii.unpackLayers(); err != nil {
		ii.fail(err)
	}
}

func (ii *imageImport) unpackLayers() error {
	if err := ii.waitFor(ii.laidOut); err != nil {
		return err
	}
	// The layout is complete and no longer changes: read without the lock.
	p, c, ctx := ii.p, ii.c, ii.ctx
	snName := ii.im.cfg.Snapshotter
	sn, applier, cs := c.SnapshotService(snName), c.DiffService(), c.ContentStore()
	unpackStart := time.Now()
	var chain []digest.Digest
	for i, l := range p.layers {
		if err := ii.waitFor(ii.stored[l.desc.Digest]); err != nil {
			return err
		}
		layer := rootfs.Layer{
			Diff: ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: p.diffIDs[i]},
			Blob: l.desc,
		}
		applied, err := rootfs.ApplyLayerWithOpts(ctx, layer, chain, sn, applier, nil, nil)
		if err != nil {
			return ii.im.wrap(c, fmt.Sprintf("unpacking %s for %s: layer %d, %s", p.name, snName, i, l.desc.Digest), err)
		}
		if applied {
			// The diff ID is verified by the apply.
			info := content.Info{Digest: l.desc.Digest, Labels: map[string]string{labels.LabelUncompressed: p.diffIDs[i].String()}}
			if _, err := cs.Update(ctx, info, "labels."+labels.LabelUncompressed); err != nil {
				return ii.im.wrap(c, fmt.Sprintf("labelling %s", l.desc.Digest), err)
			}
		}
		chain = append(chain, p.diffIDs[i])
	}
	if err := ii.waitFor(ii.stored[p.config.desc.Digest]); err != nil {
		return err
	}
	key := "containerd.io/gc.ref.snapshot." + snName
	info := content.Info{Digest: p.config.desc.Digest, Labels: map[string]string{key: identity.ChainID(chain).String()}}
	if _, err := cs.Update(ctx, info, "labels."+key); err != nil {
		return ii.im.wrap(c, fmt.Sprintf("labelling %s", p.config.desc.Digest), err)
	}
	ii.im.log.Debug("image unpacked", "image", p.name, "snapshotter", snName, "layers", len(p.layers), "duration", time.Since(unpackStart))
	return nil
}

// Commit hands over the blobs not handed yet (every blob must be complete
// in the cache now), waits for the writes and the unpack, writes the
// manifests and the index, and creates the image records. On error nothing
// is left but content the lease held, for the GC to take. Commit or Abort
// ends the import; a second call fails.
func (ii *imageImport) Commit(ctx context.Context) error {
	ii.mu.Lock()
	if ii.closing {
		ii.mu.Unlock()
		return errors.New("image import ended")
	}
	ii.closing = true
	// Open the rest first: one missing fails before they are written.
	var rest []*planBlob
	for _, b := range ii.p.blobs {
		if ii.handed[b.desc.Digest] || ii.err != nil {
			continue
		}
		if err := ii.p.open(b, ii.im.blobs); err != nil {
			ii.failLocked(err)
			break
		}
		rest = append(rest, b)
	}
	for _, b := range rest {
		if ii.err != nil {
			break
		}
		_ = ii.handLocked(b) // its error is ii.err
	}
	ii.mu.Unlock()

	// Commit's ctx ending ends the import.
	stop := context.AfterFunc(ctx, func() { ii.fail(context.Cause(ctx)) })
	defer stop()
	err := ii.finish()
	ii.end(err)
	return err
}

func (ii *imageImport) finish() error {
	ii.mu.Lock()
	err, ready := ii.err, ii.p.ready
	ii.mu.Unlock()
	if err != nil {
		return err
	}
	if !ready {
		return fmt.Errorf("image %s: the layout is incomplete with every blob handed over", ii.p.name)
	}
	// The unpacker waits for the layers and the config to be written; once
	// it is done, so are they (or the import failed).
	<-ii.unpacked
	ii.workers.Wait()
	ii.mu.Lock()
	err = ii.err
	ii.mu.Unlock()
	if err != nil {
		return err
	}
	for _, b := range ii.p.parents() {
		n, linked, err := ii.im.writeBlob(ii.ctx, ii.c, ii.c.ContentStore(), ii.p.name, b)
		ii.im.m.bytes.Add(float64(n))
		ii.mu.Lock()
		ii.written += n
		ii.linked += linked
		ii.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return ii.im.putRecords(ii.ctx, ii.c, ii.p)
}

// Abort ends the import without records: it stops the writes and the
// unpack and releases the lease, so the GC takes what was written. It does
// nothing once Commit or Abort returned.
func (ii *imageImport) Abort() {
	ii.mu.Lock()
	if ii.ended {
		ii.mu.Unlock()
		return
	}
	ii.closing = true
	ii.failLocked(errAborted)
	err := ii.err
	ii.mu.Unlock()
	ii.end(err)
}

// end waits for the workers, releases the lease, the name and the files,
// and records the outcome.
func (ii *imageImport) end(err error) {
	ii.mu.Lock()
	if ii.ended {
		ii.mu.Unlock()
		return
	}
	ii.ended = true
	ii.mu.Unlock()
	if err != nil {
		ii.cancel(err)
	}
	ii.workers.Wait()
	ii.cancel(nil)
	// The image record (or the failure) makes the lease moot; delete it
	// even though ctx has ended.
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ii.ctx), 10*time.Second)
	if derr := ii.releaseLease(dctx); derr != nil {
		ii.im.log.Debug("deleting the import lease", "image", ii.p.name, "error", derr)
	}
	cancel()
	ii.unlock()
	ii.mu.Lock()
	ii.p.close()
	written, linked := ii.written, ii.linked
	ii.mu.Unlock()
	ii.im.observe(ii.p.name, ii.start, written, linked, err)
}
