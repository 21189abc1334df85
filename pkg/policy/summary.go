package policy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// SummaryConfig tunes a Summarizer. Zero fields take the defaults of
// DefaultSummaryConfig.
type SummaryConfig struct {
	// Interval is the least time between two writes of one policy's
	// counts (default 10s): the counts are up to one Interval late, and
	// a rollout to N nodes costs the policy's N watchers one delivery per
	// Interval, not one per node.
	Interval time.Duration
	// LeaseNamespace and LeaseName name the coordination.k8s.io Lease
	// that elects the one agent that summarises (defaults weightd-system
	// and weightd-policy-summary).
	LeaseNamespace, LeaseName string
	// LeaseDuration, RenewDeadline and RetryPeriod are the election's
	// timing (client-go's leaderelection; defaults 60s, 45s, 15s). Every
	// agent campaigns: each that does not lead reads the Lease every
	// RetryPeriod to 2.2 RetryPeriods, so the defaults are far gentler than
	// a control plane's (15s, 10s, 2s for two or three candidates). A
	// leader that stops gives the Lease up, and another takes over within
	// one such poll; one that dies, within LeaseDuration more.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// Candidate says whether this agent campaigns now (default: always).
	// Every candidate that does not lead reads the Lease every
	// RetryPeriod or so: bounding the candidates bounds those reads. One
	// that stops being a candidate while it campaigns stops within a
	// RetryPeriod; one that leads keeps the Lease until it loses it.
	Candidate func() bool
	// Logger (default: discard).
	Logger *slog.Logger
	// Registerer, when set, gets the Summarizer's metrics while Run runs:
	// weightd_policy_summary_writes_total and weightd_policy_summary_leader.
	Registerer prometheus.Registerer
}

// DefaultSummaryConfig returns the defaults.
func DefaultSummaryConfig() SummaryConfig {
	return SummaryConfig{
		Interval:       10 * time.Second,
		LeaseNamespace: "weightd-system",
		LeaseName:      "weightd-policy-summary",
		LeaseDuration:  60 * time.Second,
		RenewDeadline:  45 * time.Second,
		RetryPeriod:    15 * time.Second,
		Logger:         slog.New(slog.DiscardHandler),
	}
}

// Summarizer writes the counts of every PrefetchPolicy's status from its
// PrefetchPolicyNodes. Every agent runs one; the one that holds the Lease
// watches the PrefetchPolicyNodes (the only watcher of them), the policies
// and the Nodes' metadata, and applies a policy's counts when they changed,
// at most once per Interval. The objects of a deleted Node are not counted
// (a scale-down must not leave nodes counted ready), but stay until their
// policy goes: no agent may delete another node's. Create it with
// NewSummarizer and run it with Run.
type Summarizer struct {
	id   string
	kube kubernetes.Interface
	dyn  dynamic.Interface
	meta metadata.Interface
	cfg  SummaryConfig
	log  *slog.Logger
	m    summaryMetrics
}

// NewSummarizer returns a Summarizer that campaigns as identity (the node's
// name) for the Lease through kube, reads and writes the policies through
// dyn, and lists the Nodes through meta. It starts nothing: call Run.
func NewSummarizer(identity string, kube kubernetes.Interface, dyn dynamic.Interface, meta metadata.Interface, cfg SummaryConfig) (*Summarizer, error) {
	switch {
	case identity == "":
		return nil, errors.New("policy summarizer: empty identity")
	case kube == nil || dyn == nil || meta == nil:
		return nil, errors.New("policy summarizer: nil Kubernetes client")
	}
	def := DefaultSummaryConfig()
	if cfg.Interval <= 0 {
		cfg.Interval = def.Interval
	}
	if cfg.LeaseNamespace == "" {
		cfg.LeaseNamespace = def.LeaseNamespace
	}
	if cfg.LeaseName == "" {
		cfg.LeaseName = def.LeaseName
	}
	if cfg.LeaseDuration <= 0 {
		cfg.LeaseDuration = def.LeaseDuration
	}
	if cfg.RenewDeadline <= 0 {
		cfg.RenewDeadline = def.RenewDeadline
	}
	if cfg.RetryPeriod <= 0 {
		cfg.RetryPeriod = def.RetryPeriod
	}
	if cfg.Logger == nil {
		cfg.Logger = def.Logger
	}
	if cfg.Candidate == nil {
		cfg.Candidate = func() bool { return true }
	}
	if cfg.RenewDeadline >= cfg.LeaseDuration || cfg.RetryPeriod >= cfg.RenewDeadline {
		return nil, fmt.Errorf("policy summarizer: want RetryPeriod (%v) < RenewDeadline (%v) < LeaseDuration (%v)",
			cfg.RetryPeriod, cfg.RenewDeadline, cfg.LeaseDuration)
	}
	return &Summarizer{
		id: identity, kube: kube, dyn: dyn, meta: meta, cfg: cfg,
		log: cfg.Logger.With("component", "policy-summary", "node", identity),
		m:   newSummaryMetrics(),
	}, nil
}

// Run campaigns for the Lease while the agent is a candidate, until ctx
// ends, summarising while it holds it, and then returns nil, giving the
// Lease up so that another agent takes over at once.
func (s *Summarizer) Run(ctx context.Context) error {
	unregister, err := register(s.cfg.Registerer, s.m.collectors())
	if err != nil {
		return fmt.Errorf("registering policy summary metrics: %w", err)
	}
	defer unregister()
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: s.cfg.LeaseNamespace, Name: s.cfg.LeaseName},
		Client:     s.kube.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: s.id},
	}
	for ctx.Err() == nil {
		if !s.cfg.Candidate() {
			s.m.candidate.Set(0)
			select {
			case <-ctx.Done():
			case <-time.After(s.cfg.RetryPeriod):
			}
			continue
		}
		// The elector returns when it loses the Lease; OnStartedLeading
		// runs on a goroutine of its own, waited for here so that a
		// deposed leader stops writing before it campaigns again. (One
		// that starts after Run returned finds its context ended.)
		started, led := make(chan struct{}), make(chan struct{})
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock:            lock,
			LeaseDuration:   s.cfg.LeaseDuration,
			RenewDeadline:   s.cfg.RenewDeadline,
			RetryPeriod:     s.cfg.RetryPeriod,
			ReleaseOnCancel: true,
			Name:            s.cfg.LeaseName,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					close(started)
					defer close(led)
					s.m.leader.Set(1)
					defer s.m.leader.Set(0)
					s.log.Info("elected to summarise PrefetchPolicy status")
					s.lead(ctx)
				},
				// Required by client-go; Run's loop says it.
				OnStoppedLeading: func() {},
			},
		})
		if err != nil {
			return fmt.Errorf("policy summarizer: %w", err)
		}
		s.m.candidate.Set(1)
		campaign, stop := context.WithCancel(ctx)
		go s.standDown(campaign, stop, started)
		le.Run(campaign)
		stop()
		select {
		case <-started:
			<-led
			s.log.Info("no longer summarising PrefetchPolicy status")
		default:
		}
	}
	return nil
}

// standDown ends the campaign (stop) once the agent is no longer a
// candidate, checked every RetryPeriod until it leads or ctx ends.
func (s *Summarizer) standDown(ctx context.Context, stop func(), started <-chan struct{}) {
	t := time.NewTicker(s.cfg.RetryPeriod)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-started:
			return
		case <-t.C:
			if !s.cfg.Candidate() {
				s.log.Debug("no longer a candidate for the Lease")
				stop()
				return
			}
		}
	}
}

// lead summarises until ctx ends (the Lease is lost or Run's context ends).
func (s *Summarizer) lead(ctx context.Context) {
	f := dynamicinformer.NewDynamicSharedInformerFactory(s.dyn, 0)
	defer f.Shutdown()
	pinf := f.ForResource(GVR).Informer()
	ninf := f.ForResource(NodeGVR).Informer()
	if err := pinf.SetTransform(stripManagedFields); err != nil {
		s.log.Error("policy informer", "err", err)
		return
	}
	if err := ninf.SetTransform(countedFields); err != nil {
		s.log.Error("PrefetchPolicyNode informer", "err", err)
		return
	}
	// Nodes by metadata only, and of that only the name: the leader is
	// their one extra watcher, and a Node's status is most of its bytes.
	mf := metadatainformer.NewSharedInformerFactory(s.meta, 0)
	defer mf.Shutdown()
	kinf := mf.ForResource(corev1.SchemeGroupVersion.WithResource("nodes")).Informer()
	if err := kinf.SetTransform(nameOnly); err != nil {
		s.log.Error("Node informer", "err", err)
		return
	}
	f.Start(ctx.Done())
	mf.Start(ctx.Done())
	if !toolscache.WaitForCacheSync(ctx.Done(), pinf.HasSynced, ninf.HasSynced, kinf.HasSynced) {
		return
	}
	t := time.NewTicker(s.cfg.Interval)
	defer t.Stop()
	for {
		s.summarise(ctx, pinf.GetStore(), ninf.GetStore(), kinf.GetStore())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// summarise applies the counts of every policy whose status disagrees with
// the PrefetchPolicyNodes of Nodes that exist. An apply that fails is tried
// again at the next tick.
func (s *Summarizer) summarise(ctx context.Context, policies, nodes, existing toolscache.Store) {
	// By policy UID (a policy deleted and created again is another
	// policy) and node, each node counted once whatever the objects.
	byOwner := make(map[types.UID]map[string]NodeStatus)
	for _, obj := range nodes.List() {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		owner, e, ok := counted(u)
		if !ok {
			continue
		}
		if _, exists, _ := existing.GetByKey(e.Name); !exists {
			continue
		}
		if byOwner[owner] == nil {
			byOwner[owner] = make(map[string]NodeStatus)
		}
		byOwner[owner][e.Name] = e
	}
	for _, obj := range policies.List() {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		p, err := FromUnstructured(u)
		if err != nil {
			s.log.Warn("skipping a policy that does not convert", "policy", u.GetName(), "err", err)
			continue
		}
		n, r, f := Counts(slices.Collect(maps.Values(byOwner[p.UID])), p.Generation)
		if n == p.Status.NodeCount && r == p.Status.ReadyNodes && f == p.Status.FailedNodes {
			continue
		}
		if err := ApplyCounts(ctx, s.dyn, p.Name, n, r, f); err != nil {
			s.m.writes.WithLabelValues("error").Inc()
			if ctx.Err() == nil {
				s.log.Warn("writing the counts of a policy: will retry", "policy", p.Name, "err", err)
			}
			continue
		}
		s.m.writes.WithLabelValues("ok").Inc()
		s.log.Debug("policy counts written", "policy", p.Name, "nodes", n, "ready", r, "failed", f)
	}
}

// ApplyCounts applies the counts of the policy named name's status, as
// SummaryFieldManager. A policy deleted meanwhile is not an error.
func ApplyCounts(ctx context.Context, dyn dynamic.Interface, name string, nodes, ready, failed int32) error {
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": APIVersion,
		"kind":       Kind,
		"metadata":   map[string]any{"name": name},
		"status":     map[string]any{"nodeCount": int64(nodes), "readyNodes": int64(ready), "failedNodes": int64(failed)},
	}}
	_, err := dyn.Resource(GVR).ApplyStatus(ctx, name, obj, metav1.ApplyOptions{FieldManager: SummaryFieldManager, Force: true})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("applying the counts of policy %s: %w", name, err)
	}
	return nil
}

// counted reads what the counts need of a PrefetchPolicyNode: its policy's
// UID (its owner), its node, state and generation.
func counted(u *unstructured.Unstructured) (types.UID, NodeStatus, bool) {
	var owner types.UID
	for _, o := range u.GetOwnerReferences() {
		if o.Kind == Kind && o.APIVersion == APIVersion {
			owner = o.UID
		}
	}
	name, _, _ := unstructured.NestedString(u.Object, "status", "name")
	state, _, _ := unstructured.NestedString(u.Object, "status", "state")
	gen, _, _ := unstructured.NestedInt64(u.Object, "status", "observedGeneration")
	return owner, NodeStatus{Name: name, State: NodeState(state), ObservedGeneration: gen}, owner != "" && name != ""
}

// countedFields is the PrefetchPolicyNode informer's transform: it keeps
// what counted reads, so that the leader holds a few hundred bytes per
// object, not the lists of references.
func countedFields(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil
	}
	status, _, _ := unstructured.NestedMap(u.Object, "status")
	kept := map[string]any{}
	for _, k := range []string{"name", "state", "observedGeneration"} {
		if v, ok := status[k]; ok {
			kept[k] = v
		}
	}
	out := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": u.GetAPIVersion(), "kind": u.GetKind(), "status": kept,
	}}
	out.SetName(u.GetName())
	out.SetUID(u.GetUID())
	out.SetResourceVersion(u.GetResourceVersion())
	out.SetOwnerReferences(u.GetOwnerReferences())
	return out, nil
}

// nameOnly is the Node informer's transform: summarise needs a Node's name
// only.
func nameOnly(obj any) (any, error) {
	m, ok := obj.(*metav1.PartialObjectMetadata)
	if !ok {
		return obj, nil
	}
	out := &metav1.PartialObjectMetadata{TypeMeta: m.TypeMeta}
	out.Name, out.UID, out.ResourceVersion = m.Name, m.UID, m.ResourceVersion
	return out, nil
}
