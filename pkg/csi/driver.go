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
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
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
	// Announce, when set, tells the pod what a fresh publish gave it (the
	// agent's Kubernetes side writes an annotation and an Event). It runs
	// on its own goroutine, after the mount.
	Announce func(context.Context, Published)
	Logger   *slog.Logger
}

// Published is what a volume gave a pod.
type Published struct {
	Namespace, Pod, PodUID string
	// Volume is the pod's volume name (a persistent volume's name for a
	// PersistentVolumeClaim), taken from the kubelet's target path.
	Volume string
	// Ref is the reference as asked; Resolved names the exact revision.
	Ref, Resolved, Revision string
	Files                   int
	Bytes                   int64
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
	holds map[string][]func() // per volume key, the releases of its blobs' holds
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

func (d *Driver) volumeDir(key string) string { return filepath.Join(volumesDir(d.store), key) }

func (d *Driver) recordPath(key string) string { return filepath.Join(d.cfg.StateDir, key+".json") }

// published finds the record of volume id at target, and its key; ok is
// false when it is not published there.
func (d *Driver) published(id, target string) (rec record, key string, ok bool) {
	for _, key := range []string{volumeKey(id, target), legacyKey(id)} {
		if rec, err := readRecordFile(d.recordPath(key)); err == nil && rec.VolumeID == id && rec.Target == target {
			return rec, key, true
		}
	}
	return record{}, "", false
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

// NodeGetCapabilities implements the Node service: no staging; volume stats.
func (d *Driver) NodeGetCapabilities(context.Context, *csipb.NodeGetCapabilitiesRequest) (*csipb.NodeGetCapabilitiesResponse, error) {
	return &csipb.NodeGetCapabilitiesResponse{Capabilities: []*csipb.NodeServiceCapability{{
		Type: &csipb.NodeServiceCapability_Rpc{Rpc: &csipb.NodeServiceCapability_RPC{Type: csipb.NodeServiceCapability_RPC_GET_VOLUME_STATS}},
	}}}, nil
}

// NodeGetVolumeStats implements the Node service: a model volume is full by
// design, its bytes and inodes are the model's files, and it has no room.
func (d *Driver) NodeGetVolumeStats(_ context.Context, req *csipb.NodeGetVolumeStatsRequest) (*csipb.NodeGetVolumeStatsResponse, error) {
	id, target := req.GetVolumeId(), req.GetVolumePath()
	if id == "" || target == "" {
		return nil, status.Error(codes.InvalidArgument, "volume id and volume path are required")
	}
	rec, _, ok := d.published(id, target)
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s is not published at %s", id, target)
	}
	var bytes int64
	for _, b := range rec.Blobs {
		info, err := d.store.Stat(b)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "volume %s: blob %s: %v", id, b, err)
		}
		bytes += info.Size
	}
	return &csipb.NodeGetVolumeStatsResponse{Usage: []*csipb.VolumeUsage{
		{Unit: csipb.VolumeUsage_BYTES, Total: bytes, Used: bytes},
		{Unit: csipb.VolumeUsage_INODES, Total: int64(len(rec.Blobs)), Used: int64(len(rec.Blobs))},
	}}, nil
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
		ns = source.UnknownNamespace
	}
	if err := d.cfg.Allow.Check(ns, r.Ref.String()); err != nil {
		return nil, status.Error(codes.PermissionDenied, err.Error())
	}
	defer d.lock(id)()

	if rec, _, ok := d.published(id, target); ok {
		if rec.Ref != r.Ref.Redacted() || !slices.Equal(rec.Files, r.Files) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is published at %s as %s, not %s", id, target, rec.Ref, r.Ref.Redacted())
		}
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
	files, err := d.publish(id, target, r, st)
	if err != nil {
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
	if d.cfg.Announce != nil && r.Pod != "" {
		p := Published{Namespace: r.Namespace, Pod: r.Pod, PodUID: r.PodUID, Volume: volumeName(target),
			Ref: r.Ref.Redacted(), Resolved: resolved(r.Ref, st.Revision), Revision: st.Revision, Files: len(files)}
		for _, f := range files {
			p.Bytes += f.Size
		}
		go d.cfg.Announce(context.WithoutCancel(ctx), p)
	}
	return &csipb.NodePublishVolumeResponse{}, nil
}

// resolved names exactly what r resolved to at revision: a hub commit,
// or a registry manifest digest; other references name no revision of
// their own.
func resolved(r ref.Ref, revision string) string {
	switch r.Kind {
	case ref.KindHF:
		r.Revision = revision
	case ref.KindOCI:
		// A model artifact's revision is its manifest's sha256 (hex).
		if d := digest.NewDigestFromEncoded(digest.SHA256, revision); d.Validate() == nil {
			r.Digest = d
		}
	}
	return r.Redacted()
}

// volumeName is the pod's name for the volume mounted at target: the kubelet
// publishes at <pod dir>/volumes/kubernetes.io~csi/<name>/mount.
func volumeName(target string) string {
	dir, leaf := filepath.Split(filepath.Clean(target))
	if leaf != "mount" || filepath.Base(filepath.Dir(filepath.Clean(dir))) != "kubernetes.io~csi" {
		return ""
	}
	return filepath.Base(dir)
}

// progress is the Unavailable message the kubelet shows in the pod's events.
func progress(ref string, st prefetch.JobStatus) string {
	if st.BytesTotal == 0 {
		return fmt.Sprintf("%s: %s", ref, st.State) // queued or resolving
	}
	msg := fmt.Sprintf("%s: fetching %d%% of %s", ref, st.BytesDone*100/st.BytesTotal, bytesize.IEC(st.BytesTotal))
	if st.BytesFromPeers > 0 {
		msg += fmt.Sprintf(", %d%% from peers", st.BytesFromPeers*100/st.BytesDone)
	}
	return msg + fmt.Sprintf(" (%d of %d files)", st.FilesDone, st.FilesTotal)
}

// publish mounts the ready model st at target and returns the files it shows.
func (d *Driver) publish(id, target string, r Request, st prefetch.JobStatus) ([]content.File, error) {
	all, err := modelFiles(d.store, st.Dir)
	if err != nil {
		return nil, err
	}
	l := layout{Name: st.Model, Revision: st.Revision}
	if r.Ref.Kind == ref.KindHF && r.Ref.Revision != st.Revision {
		l.Ref = r.Ref.Revision
	}
	for _, f := range all {
		if r.Wants(f.Path) {
			l.Files = append(l.Files, f)
		}
	}
	if len(l.Files) == 0 {
		return nil, status.Errorf(codes.InvalidArgument, "files %q matches none of the model's %d files", r.Files, len(all))
	}
	key := volumeKey(id, target)
	rec := record{VolumeID: id, Target: target, Namespace: r.Namespace, Pod: r.Pod, Ref: r.Ref.Redacted(), Files: r.Files}
	for _, f := range l.Files {
		if !slices.Contains(rec.Blobs, f.Digest) {
			rec.Blobs = append(rec.Blobs, f.Digest)
		}
	}
	// The record is written before anything is linked or mounted, so that
	// whatever a crash leaves, Reconcile finds.
	if err := d.writeRecord(key, rec); err != nil {
		return nil, err
	}
	d.hold(key, rec.Blobs)
	dir := d.volumeDir(key)
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	if err := l.build(d.store, dir); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, err
	}
	if mounted, _ := isMount(target); mounted {
		if err := unmount(target); err != nil {
			return nil, err
		}
	}
	return l.Files, bindReadOnly(dir, target)
}

// hold keeps the blobs of the volume keyed key from eviction until release. Holds live in
// memory, one per blob, and the volume's record makes them durable:
// Reconcile takes them again at start. Cache pins would be durable on their
// own but cost an index transaction (an fsync) per blob on every publish.
func (d *Driver) hold(key string, blobs []digest.Digest) {
	releases := make([]func(), 0, len(blobs))
	for _, b := range blobs {
		releases = append(releases, d.store.Hold(b))
	}
	d.mu.Lock()
	old := d.holds[key]
	d.holds[key] = releases
	d.mu.Unlock()
	for _, release := range old {
		release()
	}
}

func (d *Driver) unhold(key string) {
	d.mu.Lock()
	releases := d.holds[key]
	delete(d.holds, key)
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
	if _, key, ok := d.published(id, target); ok {
		if err := d.release(key); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	return &csipb.NodeUnpublishVolumeResponse{}, nil
}

// release drops the tree, holds and record of the volume keyed key.
func (d *Driver) release(key string) error {
	if err := os.RemoveAll(d.volumeDir(key)); err != nil {
		return err
	}
	d.unhold(key)
	if err := os.Remove(d.recordPath(key)); errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	return cache.SyncDir(d.cfg.StateDir)
}

// Reconcile runs at start, before the fetch queue: a volume whose target is
// still mounted regains its holds; one whose target is not is released.
func (d *Driver) Reconcile() error {
	recs, err := d.records()
	errs := []error{err}
	for key, rec := range recs {
		if mounted, _ := isMount(rec.Target); mounted {
			d.hold(key, rec.Blobs)
			continue
		}
		d.cfg.Logger.Info("releasing a volume no longer mounted", "volume", rec.VolumeID, "target", rec.Target)
		errs = append(errs, d.release(key))
	}
	return errors.Join(errs...)
}

func (d *Driver) writeRecord(key string, rec record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return cache.WriteFileAtomic(d.recordPath(key), b, 0o600)
}

// records reads every volume's record, by key; err joins the records that
// could not be read.
func (d *Driver) records() (map[string]record, error) {
	entries, err := os.ReadDir(d.cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("csi: reading records: %w", err)
	}
	recs := map[string]record{}
	var errs []error
	for _, e := range entries {
		key, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue // a temporary file of an interrupted write
		}
		rec, err := readRecordFile(filepath.Join(d.cfg.StateDir, e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		recs[key] = rec
	}
	return recs, errors.Join(errs...)
}

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
