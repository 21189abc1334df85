package containerd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/leases"
	"github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source"
)

// BlobOpener opens a complete, verified blob by digest: the cache's *Store.
type BlobOpener interface {
	Open(d digest.Digest) (*os.File, error)
}

// ErrUnreachable marks an import that failed because containerd did not
// answer (not running, restarting): worth retrying.
var ErrUnreachable = errors.New("containerd unreachable")

// leaseExpiry bounds how long the content of an import that never finished
// (the process died) is kept from containerd's garbage collector.
const leaseExpiry = time.Hour

// criManagedLabel is the label the CRI plugin puts on the images it pulls.
const criManagedLabel = "io.cri-containerd.image"

// Importer imports images from the cache into containerd. It connects on
// the first Import and again after containerd restarts. It is safe for
// concurrent use; imports of the same image name run one at a time.
type Importer struct {
	cfg      Config
	blobs    BlobOpener
	log      *slog.Logger
	m        *metrics
	platform platforms.MatchComparer

	mu     sync.Mutex // guards client, contentRoot and closed
	client *containerd.Client
	// contentRoot is where blobs are linked for client, "" where they are
	// not (link.go).
	contentRoot string
	closed      bool

	namesMu sync.Mutex
	names   map[string]*nameLock
}

// New returns an Importer into the containerd cfg names, reading blobs from
// blobs. Zero fields of cfg take DefaultConfig's values. It starts nothing
// and does not connect.
func New(cfg Config, blobs BlobOpener, opts ...Option) (*Importer, error) {
	if blobs == nil {
		return nil, fmt.Errorf("%w: no blob opener", ErrInvalidConfig)
	}
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	o := options{logger: slog.New(slog.DiscardHandler)}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	m, err := newMetrics(o.registerer)
	if err != nil {
		return nil, err
	}
	spec, _ := platforms.Parse(cfg.Platform) // checked by withDefaults
	return &Importer{
		cfg:      cfg,
		blobs:    blobs,
		log:      o.logger,
		m:        m,
		platform: platforms.Only(spec),
		names:    make(map[string]*nameLock),
	}, nil
}

// Config returns the configuration in use, defaults filled in.
func (im *Importer) Config() Config { return im.cfg }

// Close closes the connection to containerd; Import fails afterwards.
func (im *Importer) Close() error {
	im.mu.Lock()
	defer im.mu.Unlock()
	im.closed = true
	if im.client == nil {
		return nil
	}
	err := im.client.Close()
	im.client = nil
	return err
}

// Import makes img present and unpacked in containerd under img.Name
// (normalised: "busybox" is docker.io/library/busybox:latest). Blobs
// containerd already has are not written again; an image already imported
// costs a few round trips. The image record is created (or its target
// updated) only once every blob is in containerd and the image is unpacked.
//
// Errors: an image that cannot be valid (a manifest naming a blob the image
// lacks, no manifest for the platform) is wrapped with content.Permanent; a
// blob missing from the cache wraps the opener's error; containerd not
// answering wraps ErrUnreachable. Nothing is left half-imported: a retry
// picks up where a failed import stopped.
func (im *Importer) Import(ctx context.Context, img *source.Image) error {
	start := time.Now()
	p, err := newPlan(img, im.platform, im.cfg.Platform)
	if err == nil {
		// Everything is read before containerd is asked anything: a blob
		// missing from the cache or an invalid image fails at once.
		if err = p.openAll(im.blobs); err == nil {
			_, err = p.layout()
		}
		if err != nil {
			p.close()
		}
	}
	if err != nil {
		im.observe(nameOf(img), start, 0, 0, err)
		return err
	}
	ii, err := im.begin(ctx, p, start, true)
	if err != nil {
		return err
	}
	return ii.Commit(ctx)
}

// Begin starts an import of img whose blobs are still arriving in the
// cache: the caller hands each blob over with Blob as soon as it is
// complete, then calls Commit once all are (or Abort). Meanwhile the
// import writes each blob into containerd and unpacks the layers, base
// first, as soon as a layer and those below it are written, so that little
// is left to do when the last blob lands. Errors are Import's; while
// another import of the same name is under way Begin fails at once, so
// that the caller's downloads are not held up.
func (im *Importer) Begin(ctx context.Context, img *source.Image) (prefetch.ImageImport, error) {
	start := time.Now()
	p, err := newPlan(img, im.platform, im.cfg.Platform)
	if err != nil {
		im.observe(nameOf(img), start, 0, 0, err)
		return nil, err
	}
	return im.begin(ctx, p, start, false)
}

// observe records the end of an import.
func (im *Importer) observe(name string, start time.Time, written, linked int64, err error) {
	outcome := outcomeOK
	if err != nil {
		outcome = outcomeError
	}
	im.m.seconds.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	if err != nil {
		im.log.Warn("image import failed", "image", name, "error", err)
	} else {
		im.log.Info("image imported", "image", name, "bytes_written", written, "bytes_linked", linked, "duration", time.Since(start))
	}
}

// writeBlob puts one blob into the content store unless it is there
// already, in which case it only adds the labels it lacks: by a hard link
// and containerd's content sharing where it can (link.go), else by writing
// its bytes. An ingest left by an interrupted import is resumed. It returns
// the bytes written and the bytes linked.
func (im *Importer) writeBlob(ctx context.Context, c *containerd.Client, cs content.Store, name string, b *planBlob) (written, linked int64, err error) {
	d := b.desc.Digest
	info, err := cs.Info(ctx, d)
	switch {
	case err == nil:
		// Present, but maybe unreferenced (left by a failed import): the
		// lease keeps it until the records reference it, as a pull's would.
		if err := im.lease(ctx, c, d); err != nil {
			return 0, 0, err
		}
		return 0, 0, im.addLabels(ctx, c, cs, info, b)
	case !errdefs.IsNotFound(err):
		return 0, 0, im.wrap(c, fmt.Sprintf("looking up %s", d), err)
	}

	didLink := false
	if root := im.linkRoot(c); root != "" {
		didLink, err = linkBlob(root, b)
		switch {
		case errors.Is(err, errLinkRefused):
			im.log.Debug("writing a blob rather than linking it", "image", name, "digest", d, "error", err)
			if refusesAll(err) {
				im.stopLinking(c, err)
			}
		case err != nil:
			return 0, 0, fmt.Errorf("image %s: %w", name, err)
		}
	}

	// With the blob's file in the content store, containerd's writer for
	// it starts complete and Commit registers it in the namespace.
	w, err := openWriter(ctx, c, cs, content.WithRef("weightd-import-"+d.String()), content.WithDescriptor(b.desc))
	if errdefs.IsAlreadyExists(err) { // committed meanwhile by another writer
		info, err := cs.Info(ctx, d)
		if err != nil {
			return 0, 0, im.wrap(c, fmt.Sprintf("looking up %s", d), err)
		}
		return 0, 0, im.addLabels(ctx, c, cs, info, b)
	}
	if err != nil {
		return 0, 0, im.wrap(c, fmt.Sprintf("opening a writer for %s", d), err)
	}
	defer w.Close()
	st, err := w.Status()
	if err != nil {
		return 0, 0, im.wrap(c, fmt.Sprintf("writing %s", d), err)
	}
	off := st.Offset
	if didLink && off != b.desc.Size {
		im.stopLinking(c, errNotShared)
	}
	if off < 0 || off > b.desc.Size {
		if err := w.Truncate(0); err != nil {
			return 0, 0, im.wrap(c, fmt.Sprintf("writing %s", d), err)
		}
		off = 0
	}
	if off > 0 && off < b.desc.Size {
		im.log.Debug("resuming a blob's ingest", "image", name, "digest", d, "offset", off)
	}
	var n int64
	if off < b.desc.Size {
		// Each write is one message and one round trip to containerd.
		buf := make([]byte, writeChunk)
		n, err = io.CopyBuffer(writerOnly{w}, io.NewSectionReader(b.file, off, b.desc.Size-off), buf)
		if err != nil {
			return n, 0, im.wrap(c, fmt.Sprintf("writing %s", d), err)
		}
	}
	if didLink && n == 0 {
		linked = b.desc.Size
	}
	if err := w.Commit(ctx, b.desc.Size, d, content.WithLabels(b.labels)); err != nil {
		if errdefs.IsAlreadyExists(err) {
			return n, linked, nil
		}
		return n, 0, im.wrap(c, fmt.Sprintf("committing %s", d), err)
	}
	return n, linked, nil
}

// openWriter opens a content writer, waiting while another holds the ref
// (containerd says Unavailable), as content.OpenWriter does; but while
// containerd does not answer (it says Unavailable too) it fails at once
// rather than waiting for it to come back.
func openWriter(ctx context.Context, c *containerd.Client, cs content.Store, opts ...content.WriterOpt) (content.Writer, error) {
	wait := 16 * time.Millisecond
	for {
		w, err := cs.Writer(ctx, opts...)
		if err == nil || !errdefs.IsUnavailable(err) || !serving(c) {
			return w, err
		}
		select {
		case <-time.After(wait):
			wait = min(2*wait, 2*time.Second)
		case <-ctx.Done():
			return nil, err
		}
	}
}

// lease adds the content d to the import's lease.
func (im *Importer) lease(ctx context.Context, c *containerd.Client, d digest.Digest) error {
	id, ok := leases.FromContext(ctx)
	if !ok {
		return nil
	}
	err := c.LeasesService().AddResource(ctx, leases.Lease{ID: id}, leases.Resource{ID: d.String(), Type: "content"})
	if err != nil && !errdefs.IsAlreadyExists(err) {
		return im.wrap(c, fmt.Sprintf("leasing %s", d), err)
	}
	return nil
}

// addLabels sets the labels of b that info lacks.
func (im *Importer) addLabels(ctx context.Context, c *containerd.Client, cs content.Store, info content.Info, b *planBlob) error {
	if info.Size != b.desc.Size {
		return invalid("blob %s is %d bytes in containerd, the image says %d", b.desc.Digest, info.Size, b.desc.Size)
	}
	missing := map[string]string{}
	var fields []string
	for k, v := range b.labels {
		if info.Labels[k] == v {
			continue
		}
		if old := info.Labels[k]; old != "" && strings.HasPrefix(k, labels.LabelDistributionSource+".") {
			v = appendRepo(old, v)
			if v == old {
				continue
			}
		}
		missing[k] = v
		fields = append(fields, "labels."+k)
	}
	if len(fields) == 0 {
		return nil
	}
	if _, err := cs.Update(ctx, content.Info{Digest: b.desc.Digest, Labels: missing}, fields...); err != nil {
		return im.wrap(c, fmt.Sprintf("labelling %s", b.desc.Digest), err)
	}
	return nil
}

// putRecords creates the image's records, or points existing ones at the
// target: the image's name and, as the CRI plugin does on a pull, its
// repository digest ("registry/repo@sha256:…", so a pod naming the image by
// digest finds it too) and its ID (the config's digest).
func (im *Importer) putRecords(ctx context.Context, c *containerd.Client, p *plan) error {
	for _, name := range p.records {
		if err := im.putRecord(ctx, c, name, p.target); err != nil {
			return err
		}
	}
	return nil
}

func (im *Importer) putRecord(ctx context.Context, c *containerd.Client, name string, target ocispec.Descriptor) error {
	is := c.ImageService()
	rec := images.Image{Name: name, Target: target, Labels: map[string]string{criManagedLabel: "managed"}}
	existing, err := is.Get(ctx, name)
	switch {
	case err == nil:
		if existing.Target.Digest == target.Digest && existing.Labels[criManagedLabel] != "" {
			return nil
		}
	case errdefs.IsNotFound(err):
		if _, err = is.Create(ctx, rec); err == nil {
			return nil
		}
		if !errdefs.IsAlreadyExists(err) { // else created meanwhile, by a pull
			return im.wrap(c, fmt.Sprintf("creating the image record %s", name), err)
		}
	default:
		return im.wrap(c, fmt.Sprintf("looking up the image record %s", name), err)
	}
	if _, err := is.Update(ctx, rec, "target", "labels."+criManagedLabel); err != nil {
		return im.wrap(c, fmt.Sprintf("updating the image record %s", name), err)
	}
	return nil
}

// connect returns the client, connecting if there is none, and checks that
// containerd answers; a client whose connection broke (containerd
// restarted) is replaced by a fresh one.
func (im *Importer) connect(ctx context.Context) (*containerd.Client, error) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.closed {
		return nil, errors.New("importer closed")
	}
	// containerd's dialer waits for a missing socket to appear; a daemon
	// that is not running is told at once instead.
	if path, ok := socketPath(im.cfg.Address); ok {
		if _, err := os.Stat(path); err != nil {
			if im.client != nil {
				_ = im.client.Close()
				im.client = nil
			}
			return nil, fmt.Errorf("containerd at %s unreachable: %w: %w", im.cfg.Address, ErrUnreachable, err)
		}
	}
	for attempt := range 2 {
		fresh := false
		if im.client == nil {
			c, err := containerd.New(im.cfg.Address, append(dialOpts(), containerd.WithTimeout(5*time.Second))...)
			if err != nil {
				return nil, fmt.Errorf("containerd at %s unreachable: %w: %w", im.cfg.Address, ErrUnreachable, err)
			}
			im.client, im.contentRoot, fresh = c, "", true
		}
		vctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := im.client.Version(vctx)
		cancel()
		if err == nil {
			if fresh {
				im.resolveContentRoot(ctx, im.client)
			}
			return im.client, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		_ = im.client.Close()
		im.client = nil
		if attempt == 1 || !isUnreachable(err) {
			return nil, fmt.Errorf("containerd at %s unreachable: %w: %w", im.cfg.Address, ErrUnreachable, err)
		}
	}
	panic("unreachable")
}

// wrap adds what was being done to err and, if containerd stopped
// answering, marks it ErrUnreachable and drops the client so the next
// import reconnects.
func (im *Importer) wrap(c *containerd.Client, doing string, err error) error {
	// A client dropped meanwhile (another call of the same import found
	// containerd gone) fails its calls as cancelled: that is unreachable too.
	im.mu.Lock()
	dropped := im.client != c
	im.mu.Unlock()
	if !dropped && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return fmt.Errorf("%s: %w", doing, err)
	}
	if !dropped && !isUnreachable(err) && serving(c) {
		return fmt.Errorf("%s: %w", doing, err)
	}
	im.mu.Lock()
	if im.client == c {
		_ = im.client.Close()
		im.client = nil
	}
	im.mu.Unlock()
	return fmt.Errorf("%s: containerd at %s unreachable: %w: %w", doing, im.cfg.Address, ErrUnreachable, err)
}

// socketPath returns the file of a unix socket address ("/path",
// "unix:///path").
func socketPath(addr string) (string, bool) {
	if p, ok := strings.CutPrefix(addr, "unix://"); ok {
		return p, true
	}
	return addr, strings.HasPrefix(addr, "/")
}

// serving asks containerd whether it still answers: a stream cut by a
// daemon that went away does not always say so in its error.
func serving(c *containerd.Client) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	ok, err := c.IsServing(ctx)
	return err == nil && ok
}

func isUnreachable(err error) bool {
	if errdefs.IsUnavailable(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable:
		return true
	}
	return false
}

// nameLock serialises the imports of one image name.
type nameLock struct {
	ch   chan struct{} // holds a token while the name is locked
	refs int
}

// lockName takes the name's lock, waiting until ctx ends, or, unless wait,
// failing at once with errImportUnderWay if it is taken.
func (im *Importer) lockName(ctx context.Context, name string, wait bool) (unlock func(), err error) {
	im.namesMu.Lock()
	l := im.names[name]
	if l == nil {
		l = &nameLock{ch: make(chan struct{}, 1)}
		im.names[name] = l
	}
	l.refs++
	im.namesMu.Unlock()
	release := func() {
		im.namesMu.Lock()
		if l.refs--; l.refs == 0 {
			delete(im.names, name)
		}
		im.namesMu.Unlock()
	}
	if !wait {
		select {
		case l.ch <- struct{}{}:
			return func() { <-l.ch; release() }, nil
		default:
			release()
			return nil, errImportUnderWay
		}
	}
	select {
	case l.ch <- struct{}{}:
		return func() { <-l.ch; release() }, nil
	case <-ctx.Done():
		release()
		return nil, ctx.Err()
	}
}

// errImportUnderWay is Begin's error when another import of the same name
// is under way: rather than hold the caller's downloads up, it imports
// whole once they are done.
var errImportUnderWay = errors.New("another import of the image is under way")

// appendRepo adds repo to a distribution source label's comma-separated
// repositories, as containerd does.
func appendRepo(old, repo string) string {
	for r := range strings.SplitSeq(old, ",") {
		if r == repo {
			return old
		}
	}
	return old + "," + repo
}

func nameOf(img *source.Image) string {
	if img == nil {
		return ""
	}
	return img.Name
}

// writerOnly hides everything but Write, so io.CopyBuffer uses the buffer
// given rather than the reader's WriteTo with its small one.
type writerOnly struct{ io.Writer }
