package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/warmpool"
)

// WarmPool is what WarmPods needs of the warm pool; *warmpool.Pool provides
// it. Its methods are safe for concurrent use.
type WarmPool interface {
	// Servers lists the warm servers and the adapters loaded in each; a
	// server not checked yet is neither healthy nor has an error.
	Servers() []api.WarmServer
	// SetServers replaces the node's warm servers with specs (every one,
	// each time).
	SetServers(specs []warmpool.ServerSpec)
	// EnsureFor makes req's adapter available on a warm server of its base
	// on behalf of owner (a pod's UID), which keeps it in use, so not
	// evicted, until Release. Asking again for the same owner and adapter
	// is cheap and counts the owner once. Errors wrapping api.ErrBadRequest
	// will not go away by asking again (a malformed adapter, a rank over
	// the servers' maximum); others may.
	EnsureFor(ctx context.Context, owner string, req api.AdapterRequest) (api.AdapterAnswer, error)
	// Release ends owner's use of its adapters; unknown owners are ignored.
	Release(owner string)
	// Changed returns a channel that receives (or is closed) after the
	// servers or their adapters change. WarmPods asks for it again after
	// each receive.
	Changed() <-chan struct{}
}

// WarmPods defaults.
const (
	DefaultWarmInterval  = time.Second
	DefaultWarmWorkers   = 4
	DefaultEnsureTimeout = 10 * time.Minute
	// warmResync is how often WarmPods compares the servers and the
	// loaded-adapters annotations with the pool without being told to.
	warmResync = 30 * time.Second
)

// Event reasons of WarmPods (besides ReasonInvalidAnnotation).
const (
	ReasonAdapterReady  = "AdapterReady"
	ReasonAdapterFailed = "AdapterFailed"
	// ReasonWarmServerNotAllowed (Warning) is on a pod labelled a warm
	// server in a namespace the operator did not allow to hold them.
	ReasonWarmServerNotAllowed = "WarmServerNotAllowed"
)

// WarmPods is the warm pool's Kubernetes side on one node. Build it with
// NewWarmPods and call Run once. It watches the pods bound to the node (a
// field selector on spec.nodeName, each pod kept slim) and:
//
//   - finds the warm servers: pods labelled podrequest.WarmServerLabel in
//     the namespaces the operator allows (WithWarmServerNamespaces,
//     WithWarmSharedNamespaces; one elsewhere gets one Warning
//     WarmServerNotAllowed Event and is left out), whose annotations
//     podrequest.ParseWarmServer reads (a malformed one gets one Warning
//     InvalidAnnotation Event and is left out); those running with an IP are
//     given to the pool (SetServers) whenever the set changes, once changes
//     have settled for the interval;
//   - serves the pods that ask for an adapter (podrequest.ParseAdapterRequest):
//     EnsureFor on behalf of the pod's UID, for the pod's namespace (only
//     servers of that namespace or shared ones serve it), then the answer on the pod
//     (podrequest.LoraEndpoint and LoraModel, or LoraError), with an Event
//     (AdapterReady, AdapterFailed, InvalidAnnotation) each time the answer
//     on the pod changes. Failures that may pass are retried with backoff;
//     every request is asked again when the servers change (a server that
//     went is replaced by another). A pod that goes, finishes or stops
//     asking is released (Release);
//   - writes on each healthy warm server's pod the adapters loaded in it
//     (nodestate.LoadedAdaptersAnnotation), when they change, at most once
//     per interval, and removes it from pods no longer labelled as warm
//     servers.
//
// Every write is a merge patch of weightd's own annotations on the pod of
// that UID, made only when the pod shows something else; the client's rate
// limit bounds them all together. The node's warm-base labels are the
// NodePublisher's (WithWarmBases), so the two never write the same object.
type WarmPods struct {
	client kubernetes.Interface
	node   string
	pool   WarmPool
	cfg    warmConfig

	discovered atomic.Bool // the pool has been given the node's servers

	mu       sync.Mutex
	adapters map[string]*adapterPod // namespace/name → pod asking for an adapter
}

// adapterPod is a pod that asks for an adapter, as WarmPods follows it.
type adapterPod struct {
	uid         types.UID
	obj         corev1.ObjectReference // for Events
	fingerprint string                 // of its request annotations
	invalid     bool                   // the request did not parse: answered, never ensured
	// EnsureFor is due while ensured != due: due counts the reasons to ask
	// (taking the pod, a change of servers), ensured is due as it was
	// when an ensure last ended for good (succeeded, or failed for a
	// reason that does not pass).
	due, ensured uint64
	answer       loraAnswer // what the pod should show
	event        podEvent   // the Event that goes with that answer
	written      loraAnswer // last written, until the informer shows it
}

// podEvent is an Event on a pod.
type podEvent struct{ typ, reason, message string }

// loraAnswer is the agent's answer on a pod: endpoint and model, or err.
type loraAnswer struct{ endpoint, model, err string }

// shownOn reports whether annotations show the answer.
func (a loraAnswer) shownOn(annotations map[string]string) bool {
	for k, want := range a.fields() {
		got, ok := annotations[k]
		if ok != (want != "") || got != want {
			return false
		}
	}
	return true
}

func (a loraAnswer) fields() map[string]string {
	return map[string]string{podrequest.LoraEndpoint: a.endpoint, podrequest.LoraModel: a.model, podrequest.LoraError: a.err}
}

// patch is the merge patch of the answer's annotations (null removes).
func (a loraAnswer) patch() map[string]any {
	out := make(map[string]any, 3)
	for k, v := range a.fields() {
		out[k] = nil
		if v != "" {
			out[k] = v
		}
	}
	return out
}

// NewWarmPods returns the warm pool's Kubernetes side for node. It starts
// nothing: call Run.
func NewWarmPods(client kubernetes.Interface, node string, pool WarmPool, opts ...WarmOption) (*WarmPods, error) {
	if node == "" {
		return nil, errors.New("warm pods: empty node name")
	}
	if pool == nil {
		return nil, errors.New("warm pods: nil pool")
	}
	cfg := warmConfig{
		interval:         DefaultWarmInterval,
		workers:          DefaultWarmWorkers,
		ensureTimeout:    DefaultEnsureTimeout,
		retryBase:        time.Second,
		retryMax:         2 * time.Minute,
		logger:           slog.New(slog.DiscardHandler),
		serverNamespaces: make(map[string]bool),
		sharedNamespaces: make(map[string]bool),
	}
	for _, o := range opts {
		o(&cfg)
	}
	cfg.retryMax = max(cfg.retryMax, cfg.retryBase)
	return &WarmPods{client: client, node: node, pool: pool, cfg: cfg, adapters: make(map[string]*adapterPod)}, nil
}

// Tracked returns how many pods asking for an adapter WarmPods follows.
func (w *WarmPods) Tracked() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.adapters)
}

// Run watches the node's pods until ctx ends, then returns nil. The pool is
// given its first servers once the informer has listed the node's pods, and
// adapter requests are served from then on. An API server that is down
// delays that and later writes (retried), never fails Run.
func (w *WarmPods) Run(ctx context.Context) error {
	recorder, stopRecorder := w.cfg.shared.recorder(ctx, w.client, w.node)
	defer stopRecorder()
	factory, stopFactory := w.cfg.shared.pods(w.client, w.node)
	informer := factory.Core().V1().Pods().Informer()
	queue := newPodQueue("weightd-warm-pods", w.cfg.retryBase, w.cfg.retryMax)
	dirty := make(chan struct{}, 1)
	changed := func(obj any) {
		if pod, ok := obj.(*corev1.Pod); ok && (podrequest.IsWarmServer(pod.Labels) || hasAnnotation(pod, nodestate.LoadedAdaptersAnnotation)) {
			select {
			case dirty <- struct{}{}:
			default:
			}
		}
		key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
		if err != nil {
			return
		}
		if pod, ok := obj.(*corev1.Pod); (ok && asksAdapter(pod)) || w.tracked(key) {
			queue.Add(key)
		}
	}
	if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: changed,
		UpdateFunc: func(old, obj any) {
			changed(old)
			changed(obj)
		},
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				changed(t.Obj)
			}
			changed(obj)
		},
	}); err != nil {
		return fmt.Errorf("warm pods: %w", err)
	}
	factory.Start(ctx.Done())
	defer stopFactory()
	defer queue.ShutDown()
	w.cfg.logger.Info("watching this node's warm servers and adapter requests", "node", w.node)
	if !cache.WaitForCacheSync(ctx.Done(), informer.HasSynced) {
		return nil // ctx ended
	}

	s := &warmSyncer{
		w: w, indexer: informer.GetIndexer(), recorder: recorder, queue: queue,
		invalid: make(map[types.UID]string), refused: make(map[types.UID]bool), published: make(map[string]published),
	}
	s.discover()
	runWorkers(ctx, queue, w.cfg.workers, s.sync, func(key string, err error, retries int) {
		w.cfg.logger.Warn("serving adapter request; retrying", "pod", key, "err", err, "retries", retries)
	}, func(ctx context.Context) { s.loop(ctx, dirty) })
	return nil
}

// tracked reports whether key is a pod asking for an adapter.
func (w *WarmPods) tracked(key string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, ok := w.adapters[key]
	return ok
}

// warmSyncer is one Run's view of the informer, the recorder and the work
// queue. invalid, published and servers belong to the loop goroutine (and
// to Run before it starts).
type warmSyncer struct {
	w        *WarmPods
	indexer  cache.Indexer
	recorder record.EventRecorder
	queue    workqueue.TypedRateLimitingInterface[string]

	servers   []warmpool.ServerSpec // last given to the pool; nil before
	invalid   map[types.UID]string  // warm server pods reported invalid → their annotations' fingerprint
	refused   map[types.UID]bool    // warm server pods reported as in a namespace not allowed
	published map[string]published  // namespace/name → loaded-adapters written, until the informer shows it
}

// errRetry marks a sync whose adapter failed for a reason that may pass.
var errRetry = errors.New("adapter not available yet")

// sync brings one pod's adapter request up to date: ensures the adapter
// when due, and writes the answer when the pod shows another.
func (s *warmSyncer) sync(ctx context.Context, key string) error {
	w := s.w
	obj, exists, err := s.indexer.GetByKey(key)
	if err != nil {
		return err
	}
	pod, _ := obj.(*corev1.Pod)
	if !exists || pod == nil || pod.DeletionTimestamp != nil || pod.Spec.NodeName != w.node || podFinished(pod) {
		w.release(key, "")
		return nil
	}
	req, asks, perr := podrequest.ParseAdapterRequest(pod.Annotations)
	fp := annotationsFingerprint(pod, loraRequestAnnotations)
	w.mu.Lock()
	st := w.adapters[key]
	w.mu.Unlock()
	if st != nil && (st.uid != pod.UID || st.fingerprint != fp) {
		w.release(key, st.uid) // another pod of that name, or another request
		st = nil
	}
	if !asks {
		if none := (loraAnswer{}); !none.shownOn(pod.Annotations) {
			return patchAnnotations(ctx, w.client, pod, none.patch()) // an answer to a request withdrawn
		}
		return nil
	}
	if st == nil {
		st = &adapterPod{uid: pod.UID, obj: podRef(pod), fingerprint: fp, due: 1}
		if perr != nil {
			st.invalid, st.due = true, 0
			st.answer = loraAnswer{err: bound("invalid annotation: " + perr.Error())}
			st.event = podEvent{corev1.EventTypeWarning, ReasonInvalidAnnotation, bound(perr.Error())}
			w.cfg.logger.Warn("invalid adapter request", "pod", key, "err", perr)
		}
		w.mu.Lock()
		w.adapters[key] = st
		w.mu.Unlock()
	}

	var failed error
	w.mu.Lock()
	due, ensure := st.due, st.due != st.ensured
	w.mu.Unlock()
	if ensure {
		ectx, cancel := context.WithTimeout(ctx, w.cfg.ensureTimeout)
		ans, err := w.pool.EnsureFor(ectx, string(pod.UID), api.AdapterRequest{
			Base: req.Base.String(), Ref: req.Adapter.String(), Name: req.Name, Namespace: pod.Namespace,
		})
		cancel()
		if ctx.Err() != nil {
			return ctx.Err() // stopping: nothing to answer
		}
		w.mu.Lock()
		if err != nil {
			st.answer = loraAnswer{err: bound(err.Error())}
			st.event = podEvent{corev1.EventTypeWarning, ReasonAdapterFailed, bound(fmt.Sprintf("adapter %s: %v", req.Adapter.Redacted(), err))}
			if !errors.Is(err, api.ErrBadRequest) {
				failed = fmt.Errorf("%w: %w", errRetry, err) // still due
			} else {
				st.ensured = due
			}
		} else {
			st.ensured = due
			st.answer = loraAnswer{endpoint: ans.Endpoint, model: ans.Model}
			how := "already loaded"
			if ans.Loaded {
				how = "loaded in " + formatSeconds(time.Duration(ans.Seconds*float64(time.Second)))
			}
			st.event = podEvent{corev1.EventTypeNormal, ReasonAdapterReady,
				bound(fmt.Sprintf("adapter %s is model %q on %s at %s (%s)", req.Adapter.Redacted(), ans.Model, ans.Server, ans.Endpoint, how))}
		}
		w.mu.Unlock()
	}

	w.mu.Lock()
	answer, written, event := st.answer, st.written, st.event
	if answer.shownOn(pod.Annotations) {
		st.written = loraAnswer{}
	}
	w.mu.Unlock()
	if answer.shownOn(pod.Annotations) || written == answer {
		return failed // shown, or written and not shown by the informer yet
	}
	if err := patchAnnotations(ctx, w.client, pod, answer.patch()); err != nil {
		if apierrors.IsNotFound(err) {
			w.release(key, pod.UID)
			return nil
		}
		return errors.Join(failed, fmt.Errorf("writing the adapter answer: %w", err))
	}
	w.mu.Lock()
	st.written = answer
	w.mu.Unlock()
	s.recorder.Event(&st.obj, event.typ, event.reason, event.message)
	return failed
}

// release stops following the pod key (of uid, when not empty) and ends its
// use of its adapter.
func (w *WarmPods) release(key string, uid types.UID) {
	w.mu.Lock()
	st, ok := w.adapters[key]
	if ok && (uid == "" || st.uid == uid) {
		delete(w.adapters, key)
	}
	w.mu.Unlock()
	if ok && (uid == "" || st.uid == uid) {
		w.pool.Release(string(st.uid))
		w.cfg.logger.Debug("adapter request gone", "pod", key)
	}
}

// Bases returns the bases that healthy warm servers keep resident, for
// WithWarmBases: sorted, once each. known is false until Run has given the
// pool the node's servers and the pool has checked each of them (it is
// healthy or says why not), so that a restarting agent does not take the
// node's warm labels away meanwhile.
func (w *WarmPods) Bases() (bases []string, known bool) {
	if !w.discovered.Load() {
		return nil, false
	}
	for _, s := range w.pool.Servers() {
		switch {
		case s.Healthy:
			bases = append(bases, s.Base)
		case s.Error == "":
			return nil, false // not checked yet
		}
	}
	slices.Sort(bases)
	return slices.Compact(bases), true
}

// Annotations whose values identify a request or a server description.
var (
	loraRequestAnnotations = []string{podrequest.LoraBase, podrequest.LoraAdapter, podrequest.LoraName}
	warmAnnotations        = []string{podrequest.WarmBase, podrequest.WarmRuntime, podrequest.WarmPort, podrequest.WarmSlots, podrequest.WarmMaxRank}
)

// annotationsFingerprint identifies the values of keys on a pod.
func annotationsFingerprint(pod *corev1.Pod, keys []string) string {
	var b strings.Builder
	for _, k := range keys {
		v, ok := pod.Annotations[k]
		fmt.Fprintf(&b, "%t%q;", ok, v)
	}
	return b.String()
}

// asksAdapter reports whether a pod asks for an adapter or shows an answer.
func asksAdapter(pod *corev1.Pod) bool {
	for _, k := range slices.Concat(loraRequestAnnotations, []string{podrequest.LoraEndpoint, podrequest.LoraModel, podrequest.LoraError}) {
		if hasAnnotation(pod, k) {
			return true
		}
	}
	return false
}

func hasAnnotation(pod *corev1.Pod, key string) bool {
	_, ok := pod.Annotations[key]
	return ok
}

func podFinished(pod *corev1.Pod) bool {
	return pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed
}

func podRef(pod *corev1.Pod) corev1.ObjectReference {
	return corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID}
}
