package prefetch

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mathrand "math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

// run resolves, fetches and materialises one job's model.
func (q *Queue) run(ctx context.Context, j *Job) (string, error) {
	j.setState(StateResolving, time.Now())
	q.cfg.logger.Info("prefetch job started", "job", j.id, "ref", j.ref.Redacted())

	res, blobs, err := q.resolve(ctx, j)
	if err != nil {
		return "", err
	}
	j.plan(res.Model.Name, res.Model.Revision, blobs)
	for _, b := range blobs {
		defer q.store.Hold(b.Digest)()
	}

	// An image's import starts now and takes each blob as it lands.
	var imp *streamingImport
	if res.Image != nil {
		imp = q.beginImport(ctx, j, res.Image)
		defer imp.abort()
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(q.cfg.files)
	for _, b := range blobs {
		g.Go(func() error {
			fctx, span := q.cfg.tracer.Start(gctx, "fetch", trace.WithAttributes(
				AttrBlobDigest.String(b.Digest.String()), AttrBlobSize.Int64(b.Size), AttrBlobPath.String(b.path)))
			_, err := q.store.Fetch(fctx, b.Descriptor, b.src, func(done, peers, _ int64) { j.progress(b.Digest, done, peers) })
			endSpan(span, err)
			if err != nil {
				return fmt.Errorf("fetching %s (%s): %w", b.path, b.Digest, err)
			}
			j.blobDone(b.Digest, b.Size)
			imp.blob(gctx, b.Digest)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return "", err
	}
	if res.Verify != nil {
		if err := res.Verify(q.store.Open); err != nil {
			return "", fmt.Errorf("verifying %s: %w", j.ref.Redacted(), err)
		}
	}
	if res.Image != nil {
		ictx, span := q.cfg.tracer.Start(ctx, "import", trace.WithAttributes(AttrImage.String(res.Image.Name)))
		err := q.importImage(ictx, j, res.Image, imp)
		endSpan(span, err)
		return "", err
	}
	m := res.Model
	// Unpacked files are held as each lands, so that a layer's later files
	// cannot evict its first ones, and together they cannot pass what the
	// store can hold.
	var releases []func()
	defer func() {
		for _, release := range releases {
			release()
		}
	}()
	hold := func(d digest.Digest) { releases = append(releases, q.store.Hold(d)) }
	for _, l := range res.Packed {
		uctx, span := q.cfg.tracer.Start(ctx, "unpack", trace.WithAttributes(AttrLayerDigest.String(l.Digest.String())))
		files, err := q.unpack(uctx, l, hold)
		endSpan(span, err)
		if err != nil {
			return "", fmt.Errorf("unpacking layer %s of %s: %w", l.Digest, j.ref.Redacted(), err)
		}
		m.Files = append(slices.Clip(m.Files), files...)
	}
	_, span := q.cfg.tracer.Start(ctx, "commit", trace.WithAttributes(AttrModel.String(modelRef(m.Name, m.Revision)), AttrFiles.Int(len(m.Files))))
	dir, err := q.store.Materialize(m)
	endSpan(span, err)
	if err != nil {
		return "", fmt.Errorf("materialising %s@%s: %w", m.Name, m.Revision, err)
	}
	return dir, nil
}

// resolve resolves the job's reference, retrying, and lists the blobs to
// fetch in the order to fetch them.
func (q *Queue) resolve(ctx context.Context, j *Job) (_ *source.Resolution, _ []fetchBlob, err error) {
	ctx, span := q.cfg.tracer.Start(ctx, "resolve")
	defer func() { endSpan(span, err) }()
	res, err := retry(ctx, q, "resolving", j.ref, func() (*source.Resolution, error) { return q.src.Resolve(ctx, j.ref) })
	if err != nil {
		return nil, nil, err
	}
	blobs, err := fetchList(res)
	if err != nil {
		return nil, nil, fmt.Errorf("resolving %s: %w", j.ref.Redacted(), err)
	}
	if q.cfg.order != nil && res.Image == nil {
		orderFirst(blobs, res.Model.Files, q.cfg.order.Order(modelRef(res.Model.Name, res.Model.Revision)))
	}
	span.SetAttributes(AttrModel.String(modelRef(res.Model.Name, res.Model.Revision)))
	return res, blobs, nil
}

// fetchBlob is one blob a job fetches, named by its first file or layer.
type fetchBlob struct {
	content.Descriptor
	path  string
	files int // files of the model that are this blob
	src   content.RangeOpener
	// doc is an image's index, manifest or config: fetched first, so that
	// a streaming import knows the image's layers early.
	doc bool
}

// fetchList checks a resolution and lists the distinct blobs to fetch,
// largest first: the model's files, its packed layers, the image's blobs
// (an image's index, manifest and config before all).
func fetchList(res *source.Resolution) ([]fetchBlob, error) {
	if res.Image == nil || len(res.Model.Files) > 0 {
		if err := res.Model.Validate(); err != nil {
			return nil, err
		}
	}
	var blobs []fetchBlob
	index := make(map[digest.Digest]int)
	add := func(desc content.Descriptor, path string, file bool) error {
		if err := desc.Validate(); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		i, seen := index[desc.Digest]
		if !seen {
			src := res.Blobs[desc.Digest]
			if src == nil {
				return fmt.Errorf("no source for %s (%s)", path, desc.Digest)
			}
			i = len(blobs)
			index[desc.Digest] = i
			blobs = append(blobs, fetchBlob{Descriptor: desc, path: path, src: src})
		} else if blobs[i].Size != desc.Size {
			return fmt.Errorf("%s: %s listed with sizes %d and %d", path, desc.Digest, blobs[i].Size, desc.Size)
		}
		if file {
			blobs[i].files++
		}
		return nil
	}
	for _, f := range res.Model.Files {
		if err := add(f.Descriptor, f.Path, true); err != nil {
			return nil, err
		}
	}
	for _, l := range res.Packed {
		if err := add(l.Descriptor, "layer "+l.Digest.String(), false); err != nil {
			return nil, err
		}
	}
	if img := res.Image; img != nil {
		if !slices.ContainsFunc(img.Blobs, func(b source.ImageBlob) bool { return b.Digest == img.Target.Digest }) {
			return nil, fmt.Errorf("image %s: target %s is not among its blobs", img.Name, img.Target.Digest)
		}
		for _, b := range img.Blobs {
			if err := add(b.Descriptor, b.MediaType+" "+b.Digest.String(), false); err != nil {
				return nil, err
			}
			// JSON documents, as every index, manifest and config is; layers
			// are archives.
			if b.Digest == img.Target.Digest || strings.HasSuffix(b.MediaType, "json") {
				blobs[index[b.Digest]].doc = true
			}
		}
	}
	slices.SortStableFunc(blobs, func(a, b fetchBlob) int {
		if a.doc != b.doc {
			if a.doc {
				return -1
			}
			return 1
		}
		return cmp.Compare(b.Size, a.Size)
	})
	return blobs, nil
}

// unpack stores the files of a fetched packed layer in the store, each
// bounded by its declared size, and holds each (hold) as it is stored.
func (q *Queue) unpack(ctx context.Context, l source.PackedLayer, hold func(digest.Digest)) ([]content.File, error) {
	f, err := q.store.Open(l.Digest)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return Unpack(ctx, f, l, func(_ string, r io.Reader, size int64) (content.Descriptor, error) {
		info, err := q.store.Put(ctx, r, size)
		if err != nil {
			return content.Descriptor{}, err // Unpack names the file
		}
		hold(info.Digest)
		return info.Descriptor, nil
	})
}

// importImage finishes the image's import: it commits the streaming
// import, if one runs, or hands the image to the importer whole, retrying
// errors that are not permanent (with whole imports).
func (q *Queue) importImage(ctx context.Context, j *Job, img *source.Image, imp *streamingImport) error {
	if q.cfg.importer == nil {
		q.cfg.logger.Info("image fetched into the cache; no container runtime to import it into is configured", "job", j.id, "image", img.Name)
		return nil
	}
	j.setState(StateImporting, time.Now())
	_, err := retry(ctx, q, "importing", j.ref, func() (struct{}, error) {
		if imp.usable() {
			err := imp.commit(ctx)
			imp = nil
			return struct{}{}, err
		}
		return struct{}{}, q.cfg.importer.Import(ctx, img)
	})
	return err
}

// streamingImport is the queue's side of an ImageImport: it stops handing
// blobs over after the first failure. A nil *streamingImport does nothing.
type streamingImport struct {
	imp ImageImport
	log *slog.Logger
	job string

	mu     sync.Mutex
	failed error
}

// beginImport begins a streaming import of img if the importer can, or
// returns nil: the image is then imported whole once fetched.
func (q *Queue) beginImport(ctx context.Context, j *Job, img *source.Image) *streamingImport {
	si, ok := q.cfg.importer.(StreamingImporter)
	if !ok {
		return nil
	}
	imp, err := si.Begin(ctx, img)
	if err != nil {
		// The whole import after the fetches tells, or retries.
		q.cfg.logger.Info("not importing the image while fetching it; importing it once fetched", "job", j.id, "image", img.Name, "err", err)
		return nil
	}
	return &streamingImport{imp: imp, log: q.cfg.logger, job: j.id}
}

// blob hands d over unless the import has failed.
func (s *streamingImport) blob(ctx context.Context, d digest.Digest) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failed != nil {
		return
	}
	if err := s.imp.Blob(ctx, d); err != nil {
		s.failed = err
		s.log.Warn("image import while fetching failed; importing once fetched", "job", s.job, "err", err)
		s.imp.Abort()
	}
}

// usable says whether the import can still be committed.
func (s *streamingImport) usable() bool {
	if s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed == nil
}

func (s *streamingImport) commit(ctx context.Context) error {
	return s.imp.Commit(ctx)
}

func (s *streamingImport) abort() {
	if s != nil {
		s.imp.Abort()
	}
}

// retry calls fn until it succeeds, fails permanently, ctx ends or the
// attempts run out, pausing with exponential backoff and jitter between
// attempts.
func retry[T any](ctx context.Context, q *Queue, what string, r ref.Ref, fn func() (T, error)) (T, error) {
	backoff := q.cfg.resolveBackoff
	for attempt := 1; ; attempt++ {
		v, err := fn()
		if err == nil {
			return v, nil
		}
		if attempt >= q.cfg.resolveAttempts || errors.Is(err, content.ErrPermanent) || ctx.Err() != nil {
			return v, err
		}
		pause := backoff/2 + mathrand.N(backoff/2+1)
		q.cfg.logger.Warn(what+" failed, retrying", "ref", r.Redacted(), "attempt", attempt, "in", pause, "err", err)
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return v, err
		case <-t.C:
		}
		backoff *= 2
	}
}
