package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/prefetch"
)

// FieldManager is the field manager (and Event source component) of
// weightd's writes.
const FieldManager = "weightd"

// Submitter queues prefetch jobs; *prefetch.Queue is one. Submit returns the
// unfinished job already queued for the same reference and requester, if
// any.
type Submitter interface {
	Submit(ref string, p prefetch.Priority, opts ...prefetch.SubmitOption) (*prefetch.Job, error)
}

// Intake defaults.
const (
	DefaultStatusInterval   = 5 * time.Second
	DefaultProgressInterval = 15 * time.Second
	DefaultFirstStatusDelay = time.Second
	DefaultIntakeWorkers    = 4
)

// IntakeOption configures a PodIntake.
type IntakeOption func(*intakeConfig)

type intakeConfig struct {
	statusInterval   time.Duration
	progressInterval time.Duration
	firstDelay       time.Duration
	tick             time.Duration
	workers          int
	logger           *slog.Logger
	registerer       prometheus.Registerer
	shared           *Shared
}

// WithIntakeShared has the intake watch pods and record Events through
// what the agent's components share.
func WithIntakeShared(s *Shared) IntakeOption {
	return func(c *intakeConfig) { c.shared = s }
}

// WithStatusInterval sets the least time between two status patches of one
// pod (default 5s) and between two that only change its percentage (default
// 15s). Values <= 0 keep the defaults.
func WithStatusInterval(status, progress time.Duration) IntakeOption {
	return func(c *intakeConfig) {
		if status > 0 {
			c.statusInterval = status
		}
		if progress > 0 {
			c.progressInterval = progress
		}
	}
}

// WithFirstStatusDelay sets how long after taking a pod its first status is
// written unless it is final by then (default 1s): a pod whose references are
// already in the cache gets "ready" in one write, not "queued" then "ready".
// A negative d keeps the default.
func WithFirstStatusDelay(d time.Duration) IntakeOption {
	return func(c *intakeConfig) {
		if d >= 0 {
			c.firstDelay = d
		}
	}
}

// WithIntakeWorkers sets how many pods are synced at once (default 4; n < 1
// keeps the default). The client's rate limit bounds their writes together.
func WithIntakeWorkers(n int) IntakeOption {
	return func(c *intakeConfig) {
		if n >= 1 {
			c.workers = n
		}
	}
}

// WithIntakeLogger sets the logger (default: discard).
func WithIntakeLogger(l *slog.Logger) IntakeOption {
	return func(c *intakeConfig) {
		if l != nil {
			c.logger = l
		}
	}
}

// WithIntakeRegisterer registers the intake's metrics on r while Run runs
// (default: not registered): weightd_pod_prefetch_ready_seconds.
func WithIntakeRegisterer(r prometheus.Registerer) IntakeOption {
	return func(c *intakeConfig) { c.registerer = r }
}

// PodIntake takes prefetch requests from the annotations of the pods bound
// to one node and answers on them. Build it with NewPodIntake and call Run
// once.
//
// Memory is bounded by the node's pods: the informer lists and watches only
// pods with spec.nodeName equal to the node, and keeps of each only its
// name, weightd.io/ annotations, container images and phase. Writes are
// bounded per pod: one Prefetching Event, one final Event, and status patches
// at most every status interval (progress-only ones every progress
// interval), the final status always; the client's QPS and burst bound them
// all together.
type PodIntake struct {
	client kubernetes.Interface
	node   string
	queue  Submitter
	cfg    intakeConfig
	ready  prometheus.Histogram

	mu   sync.Mutex
	pods map[string]*podState // namespace/name → tracked pod
}

// podState is what the intake remembers of one pod that asks for something
// (or whose request is invalid).
type podState struct {
	uid         types.UID
	obj         corev1.ObjectReference // for Events
	fingerprint string                 // of the pod's request: annotations and images
	invalid     bool                   // the request did not parse; reported
	jobs        []*prefetch.Job
	started     time.Time // taken at
	written     string    // status last written to (or found on) the pod
	lastPatch   time.Time
	notBefore   time.Time // no status patch before
	reported    string    // final status an Event was sent for (or found on the pod)
	settled     bool      // answered (ready or failed) before this process: only a final status is written
	announce    bool      // the Prefetching Event is still to be sent
	refs        []string  // redacted, for that Event
}

// NewPodIntake returns the intake of node's pods, submitting to queue. It
// starts nothing: call Run.
func NewPodIntake(client kubernetes.Interface, node string, queue Submitter, opts ...IntakeOption) (*PodIntake, error) {
	if node == "" {
		return nil, errors.New("pod intake: empty node name")
	}
	cfg := intakeConfig{
		statusInterval:   DefaultStatusInterval,
		progressInterval: DefaultProgressInterval,
		firstDelay:       DefaultFirstStatusDelay,
		tick:             time.Second,
		workers:          DefaultIntakeWorkers,
		logger:           slog.New(slog.DiscardHandler),
	}
	for _, o := range opts {
		o(&cfg)
	}
	cfg.progressInterval = max(cfg.progressInterval, cfg.statusInterval)
	ready := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "weightd_pod_prefetch_ready_seconds",
		Help: "Time from the agent first seeing a pod that asks for models or images to all of them ready on the node " +
			"(pods answered before an agent restart are not counted again).",
		Buckets: prometheus.ExponentialBuckets(0.05, 2, 18), // 50 ms … ~3.6 h
	})
	return &PodIntake{client: client, node: node, queue: queue, cfg: cfg, ready: ready, pods: make(map[string]*podState)}, nil
}

// Tracked returns how many pods the intake follows.
func (in *PodIntake) Tracked() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return len(in.pods)
}

// Run watches the node's pods until ctx ends, then returns nil. It does not
// fail when the API server is unreachable: the informer retries, and writes
// that fail are retried with backoff.
func (in *PodIntake) Run(ctx context.Context) error {
	log := in.cfg.logger
	if r := in.cfg.registerer; r != nil {
		if err := r.Register(in.ready); err != nil {
			return fmt.Errorf("registering pod intake metrics: %w", err)
		}
		defer r.Unregister(in.ready)
	}
	recorder, stopRecorder := in.cfg.shared.recorder(ctx, in.client, in.node)
	defer stopRecorder()

	factory, stopFactory := in.cfg.shared.pods(in.client, in.node)
	informer := factory.Core().V1().Pods().Informer()
	queue := newPodQueue("weightd-pods", 500*time.Millisecond, 30*time.Second)
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			queue.Add(key)
		}
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: enqueue,
	}); err != nil {
		return fmt.Errorf("pod intake: %w", err)
	}
	factory.Start(ctx.Done())
	log.Info("watching this node's pods", "node", in.node)

	s := &syncer{in: in, indexer: informer.GetIndexer(), recorder: recorder, queue: queue}
	runWorkers(ctx, queue, in.cfg.workers, s.sync, func(key string, err error, retries int) {
		log.Warn("syncing pod; retrying", "pod", key, "err", err, "retries", retries)
	}, func(ctx context.Context) { in.tick(ctx, queue) })
	stopFactory()
	return nil
}

// tick queues, every second, the tracked pods whose status has changed and
// may be written now.
func (in *PodIntake) tick(ctx context.Context, queue workqueue.TypedRateLimitingInterface[string]) {
	t := time.NewTicker(in.cfg.tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		var due []string
		in.mu.Lock()
		for key, st := range in.pods {
			if st.invalid {
				continue
			}
			status := st.status()
			// A progress-only wait never holds back the final status.
			if now.Before(st.notBefore) && !finalStatus(status) {
				continue
			}
			if (status != st.written && (!st.settled || finalStatus(status))) || (finalStatus(status) && st.reported != status) {
				due = append(due, key)
			}
		}
		in.mu.Unlock()
		for _, key := range due {
			queue.Add(key)
		}
	}
}

// status is the pod's status now. in.mu is held (or st is not shared yet).
func (st *podState) status() string { return PodStatus(st.statuses()) }

func (st *podState) statuses() []prefetch.JobStatus {
	out := make([]prefetch.JobStatus, len(st.jobs))
	for i, j := range st.jobs {
		out[i] = j.Status()
	}
	return out
}

// syncer is one Run's view of the informer, the recorder and the work
// queue.
type syncer struct {
	in       *PodIntake
	indexer  cache.Indexer
	recorder record.EventRecorder
	queue    workqueue.TypedRateLimitingInterface[string]
}

// sync brings one pod up to date: takes its request, submits it, writes its
// status and Events as they are due.
func (s *syncer) sync(ctx context.Context, key string) error {
	in := s.in
	obj, exists, err := s.indexer.GetByKey(key)
	if err != nil {
		return err
	}
	pod, _ := obj.(*corev1.Pod)
	if !exists || pod == nil || pod.DeletionTimestamp != nil || pod.Spec.NodeName != in.node ||
		pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		if in.forget(key) {
			in.cfg.logger.Debug("pod gone or finished", "pod", key)
		}
		return nil // its jobs go on: another pod or a policy may want them
	}
	now := time.Now()
	fp := fingerprint(pod)

	in.mu.Lock()
	st := in.pods[key]
	changed := st != nil && st.uid == pod.UID && st.fingerprint != fp
	if st != nil && (st.uid != pod.UID || st.fingerprint != fp) {
		st = nil // a new pod of the same name, or a changed request
	}
	in.mu.Unlock()

	if st == nil {
		ref := corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID}
		req, err := podrequest.Parse(pod.Annotations, podImages(pod))
		if err != nil {
			in.mu.Lock()
			in.pods[key] = &podState{uid: pod.UID, obj: ref, fingerprint: fp, invalid: true}
			in.mu.Unlock()
			in.cfg.logger.Warn("invalid weightd annotation", "pod", key, "err", err)
			s.recorder.Event(&ref, corev1.EventTypeWarning, ReasonInvalidAnnotation, bound(err.Error()))
			return nil
		}
		if req.Empty() {
			in.forget(key)
			return nil
		}
		st = &podState{uid: pod.UID, obj: ref, fingerprint: fp, started: now, notBefore: now.Add(in.cfg.firstDelay)}
		var refs []string
		for _, r := range req.Refs() {
			// On the pod's behalf: the agent's credentials only where the
			// operator allows its namespace them.
			j, err := in.queue.Submit(r.String(), prefetch.PriorityPod, prefetch.ForNamespace(pod.Namespace))
			if err != nil {
				return fmt.Errorf("submitting %s: %w", r.Redacted(), err)
			}
			st.jobs = append(st.jobs, j)
			refs = append(refs, r.Redacted())
		}
		// A pod already answered (by this agent before a restart) is not
		// announced again; its jobs are cache hits or resume. A changed
		// request is announced and answered anew.
		st.written = pod.Annotations[podrequest.Status]
		if finalStatus(st.written) && !changed {
			st.reported = st.written
			st.settled = true
		}
		// Announced at the first status unless ready by then: a pod whose
		// references are all on the node gets only Prefetched.
		st.announce = st.written == "" || changed
		st.refs = refs
		in.mu.Lock()
		in.pods[key] = st
		in.mu.Unlock()
		in.cfg.logger.Info("pod asks for prefetch", "pod", key, "refs", refs)
	}
	if st.invalid {
		return nil
	}

	in.mu.Lock()
	jobs := st.statuses()
	status := PodStatus(jobs)
	written, lastPatch, notBefore, reported, announce := st.written, st.lastPatch, st.notBefore, st.reported, st.announce
	in.mu.Unlock()

	if announce && (finalStatus(status) || !now.Before(st.started.Add(in.cfg.firstDelay))) {
		if !finalStatus(status) {
			s.recorder.Event(&st.obj, corev1.EventTypeNormal, ReasonPrefetching, prefetchingMessage(st.refs))
		}
		in.mu.Lock()
		st.announce = false
		in.mu.Unlock()
	}

	if finalStatus(status) && reported != status {
		if statusKind(status) == StatusReady {
			s.recorder.Event(&st.obj, corev1.EventTypeNormal, ReasonPrefetched, bound(prefetchedMessage(jobs, st.started)))
			in.ready.Observe(readySeconds(jobs, st.started).Seconds())
		} else {
			s.recorder.Event(&st.obj, corev1.EventTypeWarning, ReasonPrefetchFailed, bound(strings.TrimPrefix(status, StatusFailed+": ")))
		}
		in.mu.Lock()
		st.reported = status
		in.mu.Unlock()
	}
	if status == written || (st.settled && !finalStatus(status)) {
		return nil // a pod answered before a restart does not go back to fetching
	}
	wait := lastPatch.Add(in.cfg.statusInterval)
	if statusKind(status) == statusKind(written) {
		wait = lastPatch.Add(in.cfg.progressInterval) // progress only
	}
	if !finalStatus(status) && notBefore.After(wait) {
		wait = notBefore
	}
	if d := wait.Sub(now); d > 0 {
		in.mu.Lock()
		st.notBefore = wait
		in.mu.Unlock()
		s.queue.AddAfter(key, d)
		return nil
	}
	in.cfg.logger.Debug("writing pod status", "pod", key, "status", status)
	if err := in.patchStatus(ctx, pod, status); err != nil {
		if apierrors.IsNotFound(err) {
			in.forget(key)
			return nil
		}
		return err
	}
	in.mu.Lock()
	st.written, st.lastPatch = status, time.Now()
	in.mu.Unlock()
	return nil
}

// patchStatus writes the status annotation with a merge patch of that one
// key, on the pod of that UID only.
func (in *PodIntake) patchStatus(ctx context.Context, pod *corev1.Pod, status string) error {
	return patchAnnotations(ctx, in.client, pod, map[string]any{podrequest.Status: status})
}

// patchAnnotations writes annotations (a nil value removes one) with a merge
// patch of those keys, on the pod of that UID only: a pod of the same name
// but another UID is NotFound.
func patchAnnotations(ctx context.Context, client kubernetes.Interface, pod *corev1.Pod, annotations map[string]any) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":         pod.UID,
		"annotations": annotations,
	}})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err = client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch,
		metav1.PatchOptions{FieldManager: FieldManager})
	if apierrors.IsConflict(err) {
		return apierrors.NewNotFound(corev1.Resource("pods"), pod.Name) // the UID changed: another pod
	}
	return err
}

// forget stops following a pod, if it did; its jobs go on.
func (in *PodIntake) forget(key string) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	_, ok := in.pods[key]
	delete(in.pods, key)
	return ok
}

// podImages lists the pod's container images, init containers first.
func podImages(pod *corev1.Pod) []string {
	images := make([]string, 0, len(pod.Spec.InitContainers)+len(pod.Spec.Containers))
	for _, c := range pod.Spec.InitContainers {
		images = append(images, c.Image)
	}
	for _, c := range pod.Spec.Containers {
		images = append(images, c.Image)
	}
	return images
}

// fingerprint identifies what a pod asks for: the annotations Parse reads and
// its images.
func fingerprint(pod *corev1.Pod) string {
	var b strings.Builder
	for _, k := range []string{podrequest.Models, podrequest.PrefetchImages, podrequest.RequireWarm} {
		v, ok := pod.Annotations[k]
		fmt.Fprintf(&b, "%t%q;", ok, v)
	}
	if pod.Annotations[podrequest.PrefetchImages] != "" {
		for _, image := range podImages(pod) {
			fmt.Fprintf(&b, "%q;", image)
		}
	}
	return b.String()
}

// slimPod is the pod informer's transform: it keeps of a pod only what the
// intake and WarmPods read (the warm-server label and the pod's IP are
// WarmPods'; the images, the intake's), so that the node's pods cost little
// memory.
func slimPod(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone: its key is all that is used
	}
	slim := &corev1.Pod{
		TypeMeta: pod.TypeMeta,
		ObjectMeta: metav1.ObjectMeta{
			Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID,
			ResourceVersion: pod.ResourceVersion, DeletionTimestamp: pod.DeletionTimestamp,
		},
		Spec:   corev1.PodSpec{NodeName: pod.Spec.NodeName},
		Status: corev1.PodStatus{Phase: pod.Status.Phase, PodIP: pod.Status.PodIP},
	}
	if v, ok := pod.Labels[podrequest.WarmServerLabel]; ok {
		slim.Labels = map[string]string{podrequest.WarmServerLabel: v}
	}
	for k, v := range pod.Annotations {
		if strings.HasPrefix(k, "weightd.io/") {
			if slim.Annotations == nil {
				slim.Annotations = make(map[string]string)
			}
			slim.Annotations[k] = v
		}
	}
	if _, ok := pod.Annotations[podrequest.PrefetchImages]; ok {
		for _, c := range pod.Spec.InitContainers {
			slim.Spec.InitContainers = append(slim.Spec.InitContainers, corev1.Container{Name: c.Name, Image: c.Image})
		}
		for _, c := range pod.Spec.Containers {
			slim.Spec.Containers = append(slim.Spec.Containers, corev1.Container{Name: c.Name, Image: c.Image})
		}
	}
	return slim, nil
}
