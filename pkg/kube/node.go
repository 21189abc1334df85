package kube

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	applycorev1 "k8s.io/client-go/applyconfigurations/core/v1"
	"k8s.io/client-go/kubernetes"

	wcache "github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

// Jobs is what the node publisher needs of the prefetch queue;
// *prefetch.Queue provides it.
type Jobs interface {
	Submitter
	// Jobs lists the status of every job the queue knows.
	Jobs() []prefetch.JobStatus
	// Job finds a job by ID.
	Job(id string) (*prefetch.Job, bool)
}

// BlobStater tells whether a blob is complete in the cache; *cache.Store
// provides it.
type BlobStater interface {
	Stat(d digest.Digest) (wcache.Info, error)
}

// Publisher defaults.
const (
	DefaultNodeInterval         = 5 * time.Second
	DefaultNodeProgressInterval = 30 * time.Second
	DefaultMaxEntries           = 256
)

// PublisherOption configures a NodePublisher.
type PublisherOption func(*publisherConfig)

type publisherConfig struct {
	interval, progress time.Duration
	maxEntries         int
	logger             *slog.Logger
	warmBases          func() ([]string, bool)
	shared             *Shared
}

// WithNodeInterval sets the least time between two writes of the Node
// (default 5s) and between two that change only the bytes of downloads in
// flight (default 30s). Values <= 0 keep the defaults; progress is at least
// interval.
func WithNodeInterval(interval, progress time.Duration) PublisherOption {
	return func(c *publisherConfig) {
		if interval > 0 {
			c.interval = interval
		}
		if progress > 0 {
			c.progress = progress
		}
	}
}

// WithMaxEntries bounds the models and images the publisher follows, and so
// the node's labels (default 256; n < 1 keeps the default). Beyond it, failed
// entries go first, then the oldest.
func WithMaxEntries(n int) PublisherOption {
	return func(c *publisherConfig) {
		if n >= 1 {
			c.maxEntries = n
		}
	}
}

// WithPublisherLogger sets the logger (default: discard).
func WithPublisherLogger(l *slog.Logger) PublisherOption {
	return func(c *publisherConfig) {
		if l != nil {
			c.logger = l
		}
	}
}

// WithWarmBases adds to what the publisher writes a label
// nodestate.WarmLabel(base) = "ready" for each base that bases returns
// (references; those that do not parse are skipped, at most the
// publisher's max entries), asked at every interval: the bases that warm
// servers of this node keep resident now (WarmPods.Bases). While bases
// says it does not know yet (false: after a restart, before the servers
// were checked), the node's warm labels stay as they are. The labels are
// written with the others, in the same apply, and go when a base does.
func WithWarmBases(bases func() ([]string, bool)) PublisherOption {
	return func(c *publisherConfig) { c.warmBases = bases }
}

// WithPublisherShared has the publisher watch the Node through what the
// agent's components share.
func WithPublisherShared(s *Shared) PublisherOption {
	return func(c *publisherConfig) { c.shared = s }
}

// NodePublisher publishes a node's cache state on its Node object: a label
// nodestate.Label(ref) = "ready" for each reference whose latest job ended
// ready and whose blobs are all still in the cache, and the summary
// annotation nodestate.SummaryAnnotation (ready and in-flight entries first,
// most recent first, bounded by nodestate.Summary.Encode). It follows every
// job of the queue (pods', policies', people's), not only the pods'.
//
// It writes with server-side apply under the field manager "weightd" (only
// weightd's labels and annotation; others' are never touched, and labels it
// no longer applies are removed), only when the node exists (it never creates
// one), at most once per interval, and when only the bytes of downloads in
// flight changed, at most once per progress interval.
type NodePublisher struct {
	client kubernetes.Interface
	node   string
	jobs   Jobs
	blobs  BlobStater
	cfg    publisherConfig

	mu      sync.Mutex
	entries map[string]*entry // canonical ref → entry
	jobRefs map[string]string // job ID → canonical ref, for the jobs listed last
	// What was last applied (nil before the first write of this process).
	applied   map[string]string // weightd's labels
	lastWrite time.Time
	restored  bool
	writes    int
}

// entry is one model or image of the node.
type entry struct {
	ref      string // canonical: its key
	shown    string // redacted: in the summary
	jobID    string // latest job
	created  time.Time
	state    nodestate.State
	bytes    int64
	total    int64
	image    bool
	blobs    []content.Descriptor // of the job that ended ready; nil before
	blobsJob string               // that job
	changed  time.Time            // state last changed
}

// NewNodePublisher returns the publisher of node's cache state, reading jobs
// and checking blobs. It starts nothing: call Run.
func NewNodePublisher(client kubernetes.Interface, node string, jobs Jobs, blobs BlobStater, opts ...PublisherOption) (*NodePublisher, error) {
	if node == "" {
		return nil, errors.New("node publisher: empty node name")
	}
	cfg := publisherConfig{
		interval:   DefaultNodeInterval,
		progress:   DefaultNodeProgressInterval,
		maxEntries: DefaultMaxEntries,
		logger:     slog.New(slog.DiscardHandler),
	}
	for _, o := range opts {
		o(&cfg)
	}
	cfg.progress = max(cfg.progress, cfg.interval)
	return &NodePublisher{
		client: client, node: node, jobs: jobs, blobs: blobs, cfg: cfg,
		entries: make(map[string]*entry), jobRefs: make(map[string]string),
	}, nil
}

// Writes returns how many times the publisher wrote the Node.
func (p *NodePublisher) Writes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.writes
}

// Run publishes until ctx ends, then returns nil. It first waits for the
// Node (watched through an informer of that one object) and rebuilds its
// state from the node's summary annotation, resubmitting the references it
// lists as ready or fetching at PriorityBackground; then, every interval, it
// compares what it should publish with what the node shows and writes the
// difference. An unreachable API server delays writes, never fails Run.
func (p *NodePublisher) Run(ctx context.Context) error {
	factory, stopFactory := p.cfg.shared.nodes(p.client, p.node)
	informer := factory.Core().V1().Nodes().Informer()
	factory.Start(ctx.Done())
	defer stopFactory()

	t := time.NewTicker(p.cfg.interval)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		p.refresh()
		if !informer.HasSynced() {
			continue
		}
		obj, ok, _ := informer.GetStore().GetByKey(p.node)
		node, _ := obj.(*corev1.Node)
		if !ok || node == nil {
			continue // not (yet) registered: weightd never creates it
		}
		if !p.restored {
			p.restore(node)
			p.refresh()
		}
		err := p.publish(ctx, node, time.Now())
		switch {
		case err != nil && !failing:
			p.cfg.logger.Warn("writing the node's cache state; retrying every interval", "node", p.node, "err", err)
			failing = true
		case err == nil && failing:
			p.cfg.logger.Info("writing the node's cache state works again", "node", p.node)
			failing = false
		}
	}
}

// restore rebuilds the entries from the node's summary annotation and
// resubmits their references at background priority: cached blobs are not
// downloaded again, interrupted downloads resume.
func (p *NodePublisher) restore(node *corev1.Node) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.restored = true
	p.applied = make(map[string]string)
	for k, v := range node.Labels {
		if strings.HasPrefix(k, nodestate.LabelPrefix) || strings.HasPrefix(k, nodestate.WarmLabelPrefix) {
			p.applied[k] = v // weightd's, from before this process
		}
	}
	v, ok := node.Annotations[nodestate.SummaryAnnotation]
	if !ok {
		return
	}
	sum, err := nodestate.Decode(v)
	if err != nil {
		p.cfg.logger.Warn("ignoring the node's cache summary", "node", p.node, "err", err)
		return
	}
	n := 0
	for _, e := range sum.Entries {
		if e.State != nodestate.StateReady && e.State != nodestate.StateFetching {
			continue
		}
		r, err := ref.Parse(e.Ref)
		if err != nil || nodestate.Key(r.String()) != e.Key {
			continue // redacted (a signed URL) or not ours: cannot be fetched again
		}
		if _, ok := p.entries[r.String()]; ok {
			continue // already followed
		}
		j, err := p.jobs.Submit(r.String(), prefetch.PriorityBackground)
		if err != nil {
			p.cfg.logger.Warn("resubmitting a reference of the node's cache summary", "ref", e.Ref, "err", err)
			continue
		}
		st := j.Status()
		p.entries[r.String()] = &entry{
			ref: r.String(), shown: r.Redacted(), jobID: j.ID(), created: st.Created,
			state: e.State, bytes: e.Bytes, total: e.Total, image: e.Image, changed: st.Created,
		}
		n++
	}
	p.cfg.logger.Info("restored the node's cache state", "node", p.node, "resubmitted", n)
}

// refresh updates the entries from the queue's jobs and the cache.
func (p *NodePublisher) refresh() {
	statuses := p.jobs.Jobs() // oldest first
	p.mu.Lock()
	defer p.mu.Unlock()
	seen := make(map[string]string, len(statuses))
	for _, st := range statuses {
		ref, ok := p.jobRefs[st.ID]
		if !ok {
			j, found := p.jobs.Job(st.ID)
			if !found {
				continue
			}
			ref = j.Ref().String()
		}
		seen[st.ID] = ref
		p.update(ref, st)
	}
	p.jobRefs = seen

	// Blobs evicted or removed take their model's label with them.
	for ref, e := range p.entries {
		if e.state == nodestate.StateReady && e.blobs != nil && !p.present(e.blobs) {
			p.cfg.logger.Info("a model or image left the cache", "ref", e.shown)
			delete(p.entries, ref)
		}
	}
	if len(p.entries) > p.cfg.maxEntries {
		for _, e := range p.ordered()[p.cfg.maxEntries:] {
			delete(p.entries, e.ref)
		}
	}
}

// update folds one job's status into the entry of its reference. p.mu is
// held.
func (p *NodePublisher) update(ref string, st prefetch.JobStatus) {
	e := p.entries[ref]
	if e != nil && e.jobID != st.ID && st.Created.Before(e.created) {
		return // an older job of the same reference
	}
	if e == nil {
		e = &entry{ref: ref, shown: st.Ref, changed: st.Created}
		p.entries[ref] = e
	}
	e.jobID, e.created = st.ID, st.Created
	if st.BytesTotal > 0 {
		// Images have blobs but no model files.
		e.image = st.FilesTotal == 0
	}
	state := nodestate.StateFetching
	switch st.State {
	case prefetch.StateReady:
		state = nodestate.StateReady
	case prefetch.StateFailed:
		state = nodestate.StateFailed
	}
	// Content known to be on the node stays ready while a newer job for it
	// runs (a resubmission is a cache hit; a blob that went is caught by
	// refresh), and when that job fails with the blobs still here (a
	// resolve that failed does not remove what is on the node).
	if e.state == nodestate.StateReady && state != nodestate.StateReady {
		if state == nodestate.StateFetching || (e.blobs != nil && p.present(e.blobs)) {
			return
		}
	}
	if state == nodestate.StateReady && e.blobsJob != st.ID {
		e.blobs, e.blobsJob = []content.Descriptor{}, st.ID // an empty model has nothing to check
		if j, ok := p.jobs.Job(st.ID); ok {
			e.blobs = append(e.blobs, j.Blobs()...)
		}
	}
	if e.state != state {
		e.state = state
		e.changed = cmp.Or(st.Finished, st.Started, st.Created)
	}
	switch state {
	case nodestate.StateReady:
		e.bytes, e.total = st.BytesTotal, st.BytesTotal
	default:
		e.bytes, e.total = st.BytesDone, st.BytesTotal
	}
}

// present reports whether every blob is complete in the cache.
func (p *NodePublisher) present(blobs []content.Descriptor) bool {
	for _, b := range blobs {
		if _, err := p.blobs.Stat(b.Digest); err != nil {
			return false
		}
	}
	return true
}

// ordered lists the entries most important first: ready and fetching before
// failed, then most recently changed first. p.mu is held.
func (p *NodePublisher) ordered() []*entry {
	out := slices.Collect(maps.Values(p.entries))
	rank := func(e *entry) int {
		if e.state == nodestate.StateFailed {
			return 1
		}
		return 0
	}
	slices.SortFunc(out, func(a, b *entry) int {
		return cmp.Or(cmp.Compare(rank(a), rank(b)), b.changed.Compare(a.changed), cmp.Compare(a.ref, b.ref))
	})
	return out
}

// desired is what the node should show: weightd's labels and the summary.
func (p *NodePublisher) desired(node *corev1.Node) (labels map[string]string, summary nodestate.Summary) {
	labels = make(map[string]string)
	if p.cfg.warmBases != nil {
		bases, known := p.cfg.warmBases()
		if !known {
			for k, v := range node.Labels {
				if strings.HasPrefix(k, nodestate.WarmLabelPrefix) {
					labels[k] = v // kept as they are until known
				}
			}
		}
		n := 0
		for _, base := range bases {
			r, err := ref.Parse(base)
			if err != nil || n >= p.cfg.maxEntries {
				continue
			}
			if l := nodestate.WarmLabel(r.String()); labels[l] == "" {
				labels[l] = nodestate.LabelReady
				n++
			}
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	summary.V = 1
	summary.Entries = []nodestate.Entry{}
	for _, e := range p.ordered() {
		if e.state == nodestate.StateReady {
			labels[nodestate.Label(e.ref)] = nodestate.LabelReady
		}
		summary.Entries = append(summary.Entries, nodestate.Entry{
			Key: nodestate.Key(e.ref), Ref: e.shown, State: e.state, Bytes: e.bytes, Total: e.total, Image: e.image,
		})
	}
	return labels, summary
}

// publish writes the node if what it shows differs from what it should, as
// often as the intervals allow.
func (p *NodePublisher) publish(ctx context.Context, node *corev1.Node, now time.Time) error {
	labels, summary := p.desired(node)
	enc, err := summary.Encode()
	if err != nil {
		return err
	}
	p.mu.Lock()
	applied, lastWrite := p.applied, p.lastWrite
	p.mu.Unlock()

	structural := false
	for k, v := range labels {
		if node.Labels[k] != v {
			structural = true
		}
	}
	for k := range applied {
		if _, want := labels[k]; !want {
			if _, there := node.Labels[k]; there {
				structural = true
			}
		}
	}
	have := node.Annotations[nodestate.SummaryAnnotation]
	if !structural && have == enc {
		return nil
	}
	if !structural && !sameShape(have, summary) {
		structural = true
	}
	gap := p.cfg.interval
	if !structural {
		gap = p.cfg.progress // only bytes in flight changed
	}
	if now.Sub(lastWrite) < gap {
		return nil
	}

	cfg := applycorev1.Node(p.node).
		WithLabels(labels).
		WithAnnotations(map[string]string{nodestate.SummaryAnnotation: enc})
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	p.mu.Lock()
	p.lastWrite = now // a failed write waits an interval too
	p.writes++
	p.mu.Unlock()
	if _, err := p.client.CoreV1().Nodes().Apply(ctx, cfg, metav1.ApplyOptions{FieldManager: FieldManager, Force: true}); err != nil {
		return fmt.Errorf("applying node %s: %w", p.node, err)
	}
	p.mu.Lock()
	p.applied = labels
	p.mu.Unlock()
	return nil
}

// sameShape reports whether the annotation have lists the same entries in
// the same states as want, whatever their bytes.
func sameShape(have string, want nodestate.Summary) bool {
	sum, err := nodestate.Decode(have)
	if err != nil {
		return false
	}
	enc, err := want.Encode()
	if err != nil {
		return false
	}
	want, err = nodestate.Decode(enc) // as truncated
	if err != nil || len(sum.Entries) != len(want.Entries) || sum.Truncated != want.Truncated {
		return false
	}
	for i, e := range sum.Entries {
		w := want.Entries[i]
		if e.Key != w.Key || e.State != w.State || e.Total != w.Total || e.Image != w.Image {
			return false
		}
	}
	return true
}

// slimNode is the node informer's transform: only labels and annotations are
// read.
func slimNode(obj any) (any, error) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil
	}
	return &corev1.Node{TypeMeta: node.TypeMeta, ObjectMeta: metav1.ObjectMeta{
		Name: node.Name, UID: node.UID, ResourceVersion: node.ResourceVersion,
		Labels: node.Labels, Annotations: node.Annotations,
	}}, nil
}
