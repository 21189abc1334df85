package policy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
)

// Fetcher submits references to be fetched. FromQueue adapts a
// *prefetch.Queue.
type Fetcher interface {
	// Submit queues ref (canonical) at priority p, or returns the
	// unfinished job already queued or running for it.
	Submit(ref string, p prefetch.Priority) (Job, error)
}

// Job is a submitted fetch; *prefetch.Job implements it.
type Job interface {
	// Done is closed when the job has finished, ready or failed.
	Done() <-chan struct{}
	// Status is a snapshot: state, bytes, model directory, error.
	Status() prefetch.JobStatus
	// Blobs lists the blobs the job fetches, once resolved.
	Blobs() []content.Descriptor
}

// Pinner keeps blobs from eviction; *cache.Store implements it.
type Pinner interface {
	// Pin keeps the complete blob d until owner unpins it; a blob that is
	// not in the store is an error wrapping content.ErrNotFound.
	Pin(d digest.Digest, owner string) error
	// Unpin drops owner's pin; unpinning what is not pinned is no error.
	Unpin(d digest.Digest, owner string) error
	// List describes every blob, with its pin owners: the controller
	// finds the pins its policies left before a restart.
	List() []cache.Info
}

// FromQueue adapts a prefetch queue to Fetcher.
func FromQueue(q *prefetch.Queue) Fetcher { return queueFetcher{q} }

type queueFetcher struct{ q *prefetch.Queue }

func (f queueFetcher) Submit(ref string, p prefetch.Priority) (Job, error) {
	j, err := f.q.Submit(ref, p)
	if err != nil {
		return nil, err
	}
	return j, nil
}

// Config tunes a Controller. Zero fields take the defaults of
// DefaultConfig.
type Config struct {
	// Debounce is the least time between two writes of this node's status
	// of one policy (default 3s).
	Debounce time.Duration
	// RetryBase and RetryMax bound the pause before a failed reference is
	// submitted again: RetryBase doubled for each consecutive failure, at
	// most RetryMax (defaults 1m and 1h).
	RetryBase, RetryMax time.Duration
	// Resync re-evaluates every policy this often (default 10m).
	Resync time.Duration
	// Logger (default: discard).
	Logger *slog.Logger
	// Recorder records the Events on policies (default: one that writes
	// them through the clientset, started by Run).
	Recorder record.EventRecorder
	// Nodes is the informer factory of this node's Node object, shared with
	// the agent's other components (kube.Shared); its Node must keep its
	// labels. Default: one of the controller's own, started by Run.
	Nodes informers.SharedInformerFactory
	// Registerer, when set, gets the controller's metrics while Run runs:
	// weightd_policy_status_writes_total, weightd_policy_selected and
	// weightd_policy_pinned_blobs.
	Registerer prometheus.Registerer
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		Debounce:  3 * time.Second,
		RetryBase: time.Minute,
		RetryMax:  time.Hour,
		Resync:    10 * time.Minute,
		Logger:    slog.New(slog.DiscardHandler),
	}
}

// Event reasons recorded on policies.
const (
	// ReasonFailed: a reference of the policy failed on a node.
	ReasonFailed = "PrefetchFailed"
	// ReasonInvalid: a reference of the policy is malformed.
	ReasonInvalid = "InvalidReference"
)

// Controller keeps what the PrefetchPolicies select for its node fetched and
// pinned, and reports it in their status. Create it with New and run it with
// Run.
type Controller struct {
	node  string
	kube  kubernetes.Interface
	dyn   dynamic.Interface
	fetch Fetcher
	pins  Pinner
	cfg   Config
	log   *slog.Logger
	m     metrics

	// Set up by Run; everything below is touched by the worker only.
	ctx      context.Context
	rec      record.EventRecorder
	queue    workqueue.TypedRateLimitingInterface[item]
	policies toolscache.Store
	nodes    toolscache.Store

	jobs       map[string]*tracked               // canonical ref → its latest job
	pinned     map[string]map[digest.Digest]bool // policy → blobs pinned for it
	written    map[string]writtenStatus          // policy → status last written
	lastWrite  map[string]time.Time              // policy → time of that write
	cleared    map[string]bool                   // policy → status deleted, none written since
	reported   map[string]map[string]string      // policy → shown ref → reason of the Event recorded
	generation map[string]int64                  // policy → generation last reconciled while selected
}

// item is a unit of work: reconcile the policy name.
type item struct {
	name string
}

// tracked is the latest job of a reference.
type tracked struct {
	job      Job
	failures int       // consecutive failed jobs
	counted  bool      // this job's failure is in failures
	retryAt  time.Time // when a failed job may be replaced
	blobs    []digest.Digest
	listed   bool // blobs holds the ready job's blobs
}

// New returns a controller for node (the name of the Node the agent runs
// on) that reads policies and the node through dyn and kube, submits to f
// and pins in p. It starts nothing: call Run.
func New(node string, kube kubernetes.Interface, dyn dynamic.Interface, f Fetcher, p Pinner, cfg Config) (*Controller, error) {
	switch {
	case node == "":
		return nil, errors.New("policy controller: empty node name")
	case kube == nil || dyn == nil:
		return nil, errors.New("policy controller: nil Kubernetes client")
	case f == nil || p == nil:
		return nil, errors.New("policy controller: nil fetcher or pinner")
	}
	def := DefaultConfig()
	if cfg.Debounce <= 0 {
		cfg.Debounce = def.Debounce
	}
	if cfg.RetryBase <= 0 {
		cfg.RetryBase = def.RetryBase
	}
	if cfg.RetryMax < cfg.RetryBase {
		cfg.RetryMax = max(def.RetryMax, cfg.RetryBase)
	}
	if cfg.Resync <= 0 {
		cfg.Resync = def.Resync
	}
	if cfg.Logger == nil {
		cfg.Logger = def.Logger
	}
	return &Controller{
		node: node, kube: kube, dyn: dyn, fetch: f, pins: p, cfg: cfg,
		log: cfg.Logger.With("component", "policy", "node", node),
		m:   newMetrics(),
	}, nil
}

// Run watches the policies and the node until ctx ends, then returns nil.
// It keeps going when the API server is away (the informers reconnect) and
// when the CRD is not installed yet (it waits for it). It may be called
// once.
func (c *Controller) Run(ctx context.Context) error {
	if c.ctx != nil {
		return errors.New("policy controller: Run called twice")
	}
	c.ctx = ctx
	unregister, err := register(c.cfg.Registerer, c.m.collectors())
	if err != nil {
		return fmt.Errorf("registering policy metrics: %w", err)
	}
	defer unregister()
	c.jobs = make(map[string]*tracked)
	c.pinned = make(map[string]map[digest.Digest]bool)
	c.written = make(map[string]writtenStatus)
	c.lastWrite = make(map[string]time.Time)
	c.cleared = make(map[string]bool)
	c.reported = make(map[string]map[string]string)
	c.generation = make(map[string]int64)
	// Failed items are retried from 100ms up to every 30s: an API server
	// that was away is written to soon after it is back.
	c.queue = workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[item](100*time.Millisecond, 30*time.Second),
		workqueue.TypedRateLimitingQueueConfig[item]{Name: "policy"})
	defer c.queue.ShutDown()

	c.rec = c.cfg.Recorder
	if c.rec == nil {
		b := record.NewBroadcaster(record.WithContext(ctx))
		b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.kube.CoreV1().Events("")})
		defer b.Shutdown()
		c.rec = b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "weightd", Host: c.node})
	}

	pf := dynamicinformer.NewFilteredDynamicSharedInformerFactory(c.dyn, c.cfg.Resync, "", nil)
	pinf := pf.ForResource(GVR).Informer()
	if err := pinf.SetTransform(stripManagedFields); err != nil {
		return fmt.Errorf("policy informer: %w", err)
	}
	if _, err := pinf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.policyChanged(nil, obj) },
		UpdateFunc: func(old, obj any) { c.policyChanged(old, obj) },
		DeleteFunc: func(obj any) { c.policyChanged(nil, obj) },
	}); err != nil {
		return fmt.Errorf("policy informer: %w", err)
	}
	c.policies = pinf.GetStore()

	nf := c.cfg.Nodes
	if nf == nil {
		nf = informers.NewSharedInformerFactoryWithOptions(c.kube, c.cfg.Resync,
			informers.WithTweakListOptions(func(o *metav1.ListOptions) {
				o.FieldSelector = fields.OneTermEqualSelector("metadata.name", c.node).String()
			}),
			informers.WithTransform(nodeLabelsOnly))
		defer nf.Shutdown()
	}
	ninf := nf.Core().V1().Nodes().Informer()
	if _, err := ninf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { c.enqueueAll() },
		UpdateFunc: func(old, obj any) {
			o, ok1 := old.(*corev1.Node)
			n, ok2 := obj.(*corev1.Node)
			if !ok1 || !ok2 || !maps.Equal(o.Labels, n.Labels) {
				c.enqueueAll()
			}
		},
		DeleteFunc: func(any) { c.enqueueAll() },
	}); err != nil {
		return fmt.Errorf("node informer: %w", err)
	}
	c.nodes = ninf.GetStore()

	pf.Start(ctx.Done())
	nf.Start(ctx.Done())
	defer pf.Shutdown()

	c.log.Info("policy controller waiting for PrefetchPolicies and the node")
	if !toolscache.WaitForCacheSync(ctx.Done(), pinf.HasSynced, ninf.HasSynced) {
		return nil // ctx ended
	}
	// Pins of policies that were deleted, or stopped selecting this node,
	// while the agent was down are released by their first reconcile.
	for _, info := range c.pins.List() {
		for _, owner := range info.Pins {
			if name, ok := strings.CutPrefix(owner, pinPrefix); ok {
				c.pinSet(name)[info.Digest] = true
				c.queue.Add(item{name: name})
			}
		}
	}
	c.enqueueAll()
	c.log.Info("policy controller started")

	go func() {
		<-ctx.Done()
		c.queue.ShutDown()
	}()
	for c.processNext() {
	}
	return nil
}

// processNext handles one item; false once the queue is shut down.
func (c *Controller) processNext() bool {
	it, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(it)
	err := c.reconcile(it.name)
	c.updateGauges()
	if err == nil {
		c.queue.Forget(it)
		return true
	}
	if c.ctx.Err() == nil {
		c.log.Warn("policy: will retry", "policy", it.name, "err", err)
	}
	c.queue.AddRateLimited(it)
	return true
}

// updateGauges sets the gauges from the worker's state.
func (c *Controller) updateGauges() {
	pins := 0
	for _, set := range c.pinned {
		pins += len(set)
	}
	c.m.pinned.Set(float64(pins))
	c.m.selected.Set(float64(len(c.generation)))
}

// policyChanged enqueues the work an informer event calls for.
func (c *Controller) policyChanged(old, obj any) {
	if d, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return
	}
	if o, ok := old.(*unstructured.Unstructured); ok &&
		o.GetResourceVersion() != u.GetResourceVersion() &&
		o.GetGeneration() == u.GetGeneration() {
		return // the counts or metadata changed, not the spec
	}
	c.queue.Add(item{name: u.GetName()})
}

// enqueueAll enqueues every known policy for a reconcile.
func (c *Controller) enqueueAll() {
	if c.policies == nil {
		return
	}
	for _, name := range c.policies.ListKeys() {
		c.queue.Add(item{name: name})
	}
}

// nodeLabels returns the node's labels; false while the node is unknown.
func (c *Controller) nodeLabels() (map[string]string, bool) {
	obj, ok, err := c.nodes.GetByKey(c.node)
	if err != nil || !ok {
		return nil, false
	}
	n, ok := obj.(*corev1.Node)
	if !ok {
		return nil, false
	}
	return n.Labels, true
}

// policy returns the policy from the informer; nil if there is none.
func (c *Controller) policy(name string) (*PrefetchPolicy, *unstructured.Unstructured, error) {
	obj, ok, err := c.policies.GetByKey(name)
	if err != nil || !ok {
		return nil, nil, err
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil, nil, fmt.Errorf("policy %q: unexpected %T in the informer", name, obj)
	}
	p, err := FromUnstructured(u)
	return p, u, err
}

// reconcile brings this node's part of one policy in line: fetch, pin,
// report.
func (c *Controller) reconcile(name string) error {
	if c.ctx.Err() != nil {
		return nil // shutting down: jobs fail with the context, which says nothing of the content
	}
	p, u, err := c.policy(name)
	if err != nil {
		return err
	}
	if p == nil {
		if len(c.pinned[name]) > 0 {
			c.log.Info("policy gone: releasing its pins", "policy", name, "blobs", len(c.pinned[name]))
		}
		c.forget(name)
		c.pruneJobs()
		return c.unpinAll(name)
	}
	labels, known := c.nodeLabels()
	if !known {
		c.log.Debug("node not seen yet", "policy", name)
		return nil // the node's informer event enqueues every policy
	}
	match, err := Matches(p.Spec.NodeSelector, labels)
	if err != nil {
		c.log.Warn("policy selector does not parse; treating it as selecting no node", "policy", name, "err", err)
	}
	if !match {
		if err := c.unpinAll(name); err != nil {
			return err
		}
		c.reported[name] = nil
		delete(c.generation, name)
		c.pruneJobs()
		return c.removeEntry(p)
	}
	if c.generation[name] != p.Generation {
		c.generation[name] = p.Generation
		defer c.pruneJobs() // the spec may have dropped references
	}

	now := time.Now()
	wants := Wants(p.Spec)
	states := make([]RefState, 0, len(wants))
	desired := make(map[digest.Digest]bool)
	var retryIn time.Duration
	for _, w := range wants {
		if w.Err != nil {
			states = append(states, RefState{Shown: w.Shown, State: prefetch.StateFailed, Reason: w.Err.Error()})
			continue
		}
		t, err := c.track(w.Ref, now)
		if err != nil {
			states = append(states, RefState{Shown: w.Shown, State: prefetch.StateFailed, Reason: err.Error()})
			continue
		}
		st := t.job.Status()
		switch st.State {
		case prefetch.StateFailed:
			if wait := t.retryAt.Sub(now); retryIn == 0 || wait < retryIn {
				retryIn = wait
			}
		case prefetch.StateReady:
			if !t.listed {
				t.blobs, err = readyBlobs(t.job, st)
				if err != nil {
					return fmt.Errorf("listing the blobs of %s: %w", w.Shown, err)
				}
				t.listed = true
			}
			if p.Spec.Pinned() {
				if err := c.pinAll(name, t.blobs); err != nil {
					if !errors.Is(err, content.ErrNotFound) {
						return err
					}
					// Evicted before it could be pinned: fetch it again.
					c.log.Warn("blob of a ready reference gone before pinning: fetching again", "policy", name, "ref", w.Shown, "err", err)
					delete(c.jobs, w.Ref)
					c.queue.Add(item{name: name})
					st.State = prefetch.StateQueued
				}
			}
			for _, d := range t.blobs {
				desired[d] = true
			}
		}
		states = append(states, RefState{Shown: w.Shown, State: st.State, Bytes: st.BytesDone, Reason: st.Error})
	}
	if !p.Spec.Pinned() {
		clear(desired)
	}
	if err := c.unpinExcept(name, desired); err != nil {
		return err
	}
	if retryIn > 0 {
		c.queue.AddAfter(item{name: name}, retryIn)
	}

	entry := BuildEntry(c.node, p.Generation, states, now)
	c.recordFailures(u, name, wants, entry)
	return c.writeEntry(p, entry, now)
}

// track returns the job of ref, submitting it if there is none or if the
// last one failed and its pause is over.
func (c *Controller) track(ref string, now time.Time) (*tracked, error) {
	t := c.jobs[ref]
	if t != nil {
		st := t.job.Status()
		if st.State != prefetch.StateFailed {
			return t, nil
		}
		if !t.counted {
			t.counted = true
			t.failures++
			t.retryAt = st.Finished.Add(backoff(c.cfg.RetryBase, c.cfg.RetryMax, t.failures))
		}
		if now.Before(t.retryAt) {
			return t, nil
		}
	}
	j, err := c.fetch.Submit(ref, prefetch.PriorityBackground)
	if err != nil {
		return nil, err
	}
	next := &tracked{job: j}
	if t != nil && t.job != j {
		next.failures = t.failures
	}
	c.jobs[ref] = next
	go func() {
		select {
		case <-j.Done():
			c.enqueueAll()
		case <-c.ctx.Done():
		}
	}()
	return next, nil
}

// backoff is base doubled failures-1 times, at most most.
func backoff(base, most time.Duration, failures int) time.Duration {
	d := base
	for i := 1; i < failures && d < most; i++ {
		d *= 2
	}
	return min(d, most)
}

// readyBlobs lists the blobs of a ready job: those it fetched, and those
// its model directory links to (files unpacked from packed layers).
func readyBlobs(j Job, st prefetch.JobStatus) ([]digest.Digest, error) {
	seen := make(map[digest.Digest]bool)
	var out []digest.Digest
	for _, b := range j.Blobs() {
		if !seen[b.Digest] {
			seen[b.Digest] = true
			out = append(out, b.Digest)
		}
	}
	files, err := dirBlobs(st.Dir)
	if err != nil {
		return nil, err
	}
	for _, d := range files {
		if !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	return out, nil
}

// forget drops what the controller remembers of a deleted policy.
func (c *Controller) forget(name string) {
	delete(c.written, name)
	delete(c.lastWrite, name)
	delete(c.cleared, name)
	delete(c.reported, name)
	delete(c.generation, name)
}

// pruneJobs forgets the finished jobs of references that no policy
// selecting this node names any more, so that what the controller remembers
// stays bounded by what the policies name.
func (c *Controller) pruneJobs() {
	labels, _ := c.nodeLabels()
	wanted := make(map[string]bool)
	for _, obj := range c.policies.List() {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		p, err := FromUnstructured(u)
		if err != nil {
			continue
		}
		if ok, _ := Matches(p.Spec.NodeSelector, labels); !ok {
			continue
		}
		for _, w := range Wants(p.Spec) {
			wanted[w.Ref] = true
		}
	}
	for ref, t := range c.jobs {
		if !wanted[ref] && t.job.Status().State.Finished() {
			delete(c.jobs, ref)
		}
	}
}
