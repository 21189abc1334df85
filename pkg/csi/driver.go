package csi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/opencontainers/go-digest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
)

// DriverName is the CSI driver's name, as pods and the CSIDriver object name it.
const DriverName = "models.weightd.io"

// DefaultPublishWait is how long NodePublishVolume waits for a fetch before
// answering Unavailable with its progress; the kubelet then retries.
const DefaultPublishWait = 5 * time.Second

// Config configures a Driver.
type Config struct {
	// NodeID is the node's name, reported by NodeGetInfo.
	NodeID string
	// StateDir holds one record per published volume.
	StateDir string
	// TargetRoot, when set, is the only tree targets may be under (the
	// kubelet's directory): the agent mounts as root, so it refuses to
	// mount over anything else a caller of its socket names.
	TargetRoot string
	// Allow limits which references a namespace may mount; nil allows all.
	Allow Allowlist
	// PublishWait bounds how long one NodePublishVolume waits for a fetch.
	PublishWait time.Duration
	// Version is reported by GetPluginInfo.
	Version string
	Logger  *slog.Logger
}

// Driver serves the CSI Identity and Node services. Its methods are safe for
// concurrent use; calls for one volume id run one at a time.
type Driver struct {
	csipb.UnimplementedIdentityServer
	csipb.UnimplementedNodeServer

	store *cache.Store
	queue *prefetch.Queue
	cfg   Config

	mu    sync.Mutex
	locks map[string]*sync.Mutex
	holds map[string][]func() // per volume id, the releases of its blobs' holds
}

// NewDriver returns a driver publishing models from store, fetched through queue.
func NewDriver(store *cache.Store, queue *prefetch.Queue, cfg Config) (*Driver, error) {
	if cfg.NodeID == "" {
		return nil, errors.New("csi: node id is required")
	}
	if cfg.StateDir == "" {
		return nil, errors.New("csi: state directory is required")
	}
	if cfg.PublishWait <= 0 {
		cfg.PublishWait = DefaultPublishWait
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("csi: %w", err)
	}
	if err := os.MkdirAll(volumesDir(store), 0o755); err != nil {
		return nil, fmt.Errorf("csi: %w", err)
	}
	return &Driver{store: store, queue: queue, cfg: cfg, locks: map[string]*sync.Mutex{}, holds: map[string][]func(){}}, nil
}

// volumesDir holds the per-volume trees, under the cache's root so that hard
// links to its blobs stay on one filesystem.
func volumesDir(store *cache.Store) string { return filepath.Join(store.Root(), "csi-volumes") }

func (d *Driver) volumeDir(volumeID string) string {
	return filepath.Join(volumesDir(d.store), volumeKey(volumeID))
}

func (d *Driver) recordPath(volumeID string) string {
	return filepath.Join(d.cfg.StateDir, volumeKey(volumeID)+".json")
}

func (d *Driver) lock(volumeID string) func() {
	d.mu.Lock()
	l, ok := d.locks[volumeID]
	if !ok {
		l = &sync.Mutex{}
		d.locks[volumeID] = l
	}
	d.mu.Unlock()
	l.Lock()
	return l.Unlock
}

// GetPluginInfo implements the Identity service.
func (d *Driver) GetPluginInfo(context.Context, *csipb.GetPluginInfoRequest) (*csipb.GetPluginInfoResponse, error) {
	v := d.cfg.Version
	if v == "" {
		v = "dev"
	}
	return &csipb.GetPluginInfoResponse{Name: DriverName, VendorVersion: v}, nil
}

// GetPluginCapabilities implements the Identity service: a node plugin only,
// with no controller service.
func (d *Driver) GetPluginCapabilities(context.Context, *csipb.GetPluginCapabilitiesRequest) (*csipb.GetPluginCapabilitiesResponse, error) {
	return &csipb.GetPluginCapabilitiesResponse{}, nil
}

// Probe implements the Identity service.
func (d *Driver) Probe(context.Context, *csipb.ProbeRequest) (*csipb.ProbeResponse, error) {
	return &csipb.ProbeResponse{}, nil
}

// NodeGetCapabilities implements the Node service: no staging, no stats.
func (d *Driver) NodeGetCapabilities(context.Context, *csipb.NodeGetCapabilitiesRequest) (*csipb.NodeGetCapabilitiesResponse, error) {
	return &csipb.NodeGetCapabilitiesResponse{}, nil
}

// NodeGetInfo implements the Node service.
func (d *Driver) NodeGetInfo(context.Context, *csipb.NodeGetInfoRequest) (*csipb.NodeGetInfoResponse, error) {
	return &csipb.NodeGetInfoResponse{NodeId: d.cfg.NodeID}, nil
}

// NodePublishVolume implements the Node service (see the package doc).
func (d *Driver) NodePublishVolume(ctx context.Context, req *csipb.NodePublishVolumeRequest) (*csipb.NodePublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume id is required")
	case target == "" || !filepath.IsAbs(target):
		return nil, status.Errorf(codes.InvalidArgument, "target path %q is not absolute", target)
	case d.cfg.TargetRoot != "" && !strings.HasPrefix(filepath.Clean(target), filepath.Clean(d.cfg.TargetRoot)+"/"):
		return nil, status.Errorf(codes.InvalidArgument, "target path %q is not under the kubelet's directory %s", target, d.cfg.TargetRoot)
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume capability is required")
	case req.GetVolumeCapability().GetBlock() != nil:
		return nil, status.Error(codes.InvalidArgument, "a model volume is a filesystem, not a block device")
	}
	r, err := ParseAttributes(req.GetVolumeContext())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	ns := r.Namespace
	if ns == "" {
		ns = prefetch.UnknownNamespace
	}
	if err := d.cfg.Allow.Check(ns, r.Ref.String()); err != nil {
		return nil, status.Error(codes.PermissionDenied, err.Error())
	}
	defer d.lock(id)()

	if rec, err := d.readRecord(id); err == nil && rec.Target == target {
		if mounted, _ := isMount(target); mounted {
			return &csipb.NodePublishVolumeResponse{}, nil
		}
	}

	job, err := d.queue.Submit(r.Ref.String(), r.Priority, prefetch.ForNamespace(ns))
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "queueing %s: %v", r.Ref.Redacted(), err)
	}
	wait, cancel := context.WithTimeout(ctx, d.cfg.PublishWait)
	st, err := job.Wait(wait)
	cancel()
	switch {
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		return nil, status.Error(codes.Unavailable, progress(r.Ref.Redacted(), st))
	case errors.Is(err, cache.ErrDiskFull):
		return nil, status.Errorf(codes.ResourceExhausted, "%s does not fit in the node's model cache: %v", r.Ref.Redacted(), err)
	case err != nil:
		return nil, status.Errorf(codes.Unavailable, "fetching %s: %v", r.Ref.Redacted(), err)
	}
	if err := d.publish(id, target, r, st); err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, err
		}
		if broken := (*brokenBlobError)(nil); errors.As(err, &broken) {
			// Forgotten, the blob is fetched again by the kubelet's next try.
			if derr := d.store.Discard(broken.digest); derr != nil {
				return nil, status.Errorf(codes.Internal, "%s: %v; discarding it: %v", r.Ref.Redacted(), err, derr)
			}
			return nil, status.Errorf(codes.Unavailable, "%s: %v; fetching it again", r.Ref.Redacted(), err)
		}
		return nil, status.Errorf(codes.Internal, "publishing %s: %v", r.Ref.Redacted(), err)
	}
	d.cfg.Logger.Info("model volume published", "volume", id, "model", r.Ref.Redacted(), "revision", st.Revision, "namespace", ns, "pod", r.Pod)
	return &csipb.NodePublishVolumeResponse{}, nil
}

// progress is the Unavailable message the kubelet shows in the pod's events.
func progress(ref string, st prefetch.JobStatus) string {
	if st.BytesTotal == 0 {
		return fmt.Sprintf("%s: %s, resolving", ref, st.State)
	}
	return fmt.Sprintf("%s: fetching %d%% of %s (%d of %d files)", ref,
		st.BytesDone*100/st.BytesTotal, bytesize.IEC(st.BytesTotal), st.FilesDone, st.FilesTotal)
}

func (d *Driver) publish(id, target string, r Request, st prefetch.JobStatus) error {
	all, err := modelFiles(d.store, st.Dir)
	if err != nil {
		return err
	}
	l := layout{Name: st.Model, Revision: st.Revision}
	if r.Ref.Kind == prefetch.KindHF && r.Ref.Revision != st.Revision {
		l.Ref = r.Ref.Revision
	}
	for _, f := range all {
		if r.Wants(f.Path) {
			l.Files = append(l.Files, f)
		}
	}
	if len(l.Files) == 0 {
		return status.Errorf(codes.InvalidArgument, "files %q matches none of the model's %d files", r.Files, len(all))
	}
	rec := record{VolumeID: id, Target: target, Ref: r.Ref.Redacted()}
	for _, f := range l.Files {
		if !slices.Contains(rec.Blobs, f.Digest) {
			rec.Blobs = append(rec.Blobs, f.Digest)
		}
	}
	// The record is written before anything is linked or mounted, so that
	// whatever a crash leaves, Reconcile finds.
	if err := d.writeRecord(rec); err != nil {
		return err
	}
	d.hold(id, rec.Blobs)
	dir := d.volumeDir(id)
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := l.build(d.store, dir); err != nil {
		_ = os.RemoveAll(dir)
		return err
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return err
	}
	if mounted, _ := isMount(target); mounted {
		if err := unmount(target); err != nil {
			return err
		}
	}
	return bindReadOnly(dir, target)
}

// hold keeps volume id's blobs from eviction until release. Holds live in
// memory, one per blob, and the volume's record makes them durable:
// Reconcile takes them again at start. Cache pins would be durable on their
// own but cost an index transaction (an fsync) per blob on every publish.
func (d *Driver) hold(id string, blobs []digest.Digest) {
	releases := make([]func(), 0, len(blobs))
	for _, b := range blobs {
		releases = append(releases, d.store.Hold(b))
	}
	d.mu.Lock()
	old := d.holds[id]
	d.holds[id] = releases
	d.mu.Unlock()
	for _, release := range old {
		release()
	}
}

func (d *Driver) unhold(id string) {
	d.mu.Lock()
	releases := d.holds[id]
	delete(d.holds, id)
	d.mu.Unlock()
	for _, release := range releases {
		release()
	}
}

// NodeUnpublishVolume implements the Node service: it unmounts the target,
// removes the volume's tree and record, and releases its blobs. Unpublishing
// what is not published succeeds.
func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csipb.NodeUnpublishVolumeRequest) (*csipb.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	if id == "" || target == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id and target path are required")
	}
	defer d.lock(id)()
	if mounted, err := isMount(target); err == nil && mounted {
		if err := unmount(target); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "removing target: %v", err)
	}
	if err := d.release(id); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csipb.NodeUnpublishVolumeResponse{}, nil
}

// release drops volume id's tree, holds and record.
func (d *Driver) release(id string) error {
	if err := os.RemoveAll(d.volumeDir(id)); err != nil {
		return err
	}
	d.unhold(id)
	if err := os.Remove(d.recordPath(id)); errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	return cache.SyncDir(d.cfg.StateDir)
}

// Reconcile runs at start, before the fetch queue: a volume whose target is
// still mounted regains its holds; one whose target is not is released.
func (d *Driver) Reconcile() error {
	entries, err := os.ReadDir(d.cfg.StateDir)
	if err != nil {
		return fmt.Errorf("csi: reading records: %w", err)
	}
	var errs []error
	for _, e := range entries {
		rec, err := readRecordFile(filepath.Join(d.cfg.StateDir, e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if mounted, _ := isMount(rec.Target); mounted {
			d.hold(rec.VolumeID, rec.Blobs)
			continue
		}
		d.cfg.Logger.Info("releasing a volume no longer mounted", "volume", rec.VolumeID, "target", rec.Target)
		errs = append(errs, d.release(rec.VolumeID))
	}
	return errors.Join(errs...)
}

func (d *Driver) writeRecord(rec record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return cache.WriteFileAtomic(d.recordPath(rec.VolumeID), b, 0o600)
}

func (d *Driver) readRecord(id string) (record, error) { return readRecordFile(d.recordPath(id)) }

func readRecordFile(p string) (record, error) {
	var rec record
	b, err := os.ReadFile(p)
	if err != nil {
		return rec, err
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return rec, fmt.Errorf("csi record %s: %w", p, err)
	}
	return rec, nil
}
