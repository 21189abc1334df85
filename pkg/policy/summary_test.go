package policy_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/policy"
)

// summarizer is a running Summarizer with its own metrics.
type summarizer struct {
	reg  *prometheus.Registry
	stop func()
}

func startSummarizer(t *testing.T, rc *rest.Config, id, lease string) *summarizer {
	t.Helper()
	return startSummarizerWith(t, rc, id, summaryConfig(lease, slog.New(slog.DiscardHandler), nil))
}

func startSummarizerWith(t *testing.T, rc *rest.Config, id string, cfg policy.SummaryConfig) *summarizer {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	cfg.Registerer = reg
	s, err := policy.NewSummarizer(id, kubernetes.NewForConfigOrDie(rc), dynamic.NewForConfigOrDie(rc), metadata.NewForConfigOrDie(rc), cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		assert.NoError(t, s.Run(ctx))
	}()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return &summarizer{reg: reg, stop: stop}
}

func (s *summarizer) leading(t *testing.T) bool {
	return metricValue(t, s.reg, "weightd_policy_summary_leader") == 1
}

func (s *summarizer) writes(t *testing.T) float64 {
	return metricValue(t, s.reg, "weightd_policy_summary_writes_total", "outcome", "ok")
}

// writeNode applies node's status of p as its agent does, creating the
// Node if it does not exist (only existing Nodes are counted).
func writeNode(t *testing.T, dc dynamic.Interface, p *policy.PrefetchPolicy, node string, state policy.NodeState) {
	t.Helper()
	_, err := dc.Resource(corev1.SchemeGroupVersion.WithResource("nodes")).Create(t.Context(), &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "Node", "metadata": map[string]any{"name": node},
	}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	obj, err := policy.NodeStatusObject(p, policy.NodeStatus{Name: node, State: state, ObservedGeneration: p.Generation, Updated: metav1.Now()})
	require.NoError(t, err)
	_, err = dc.Resource(policy.NodeGVR).Apply(t.Context(), obj.GetName(), obj, metav1.ApplyOptions{FieldManager: policy.FieldManager(node), Force: true})
	require.NoError(t, err)
}

// TestSummarizerElection: of two Summarizers on one Lease, only the one
// that holds it counts the nodes' objects into the policy's status; when it
// stops, the other takes over. The objects are deleted with their policy
// (the API server of this test runs the garbage collector).
func TestSummarizerElection(t *testing.T) {
	kubetest.Require(t)
	e := kubetest.NewT(t, kubetest.Config{APIServerArgs: kubeConfig.APIServerArgs, ControlPlane: true})
	dc := dynamic.NewForConfigOrDie(e.Config)
	require.NoError(t, policy.InstallCRD(t.Context(), dc))
	require.NoError(t, e.EnsureNamespace(t.Context(), leaseNamespace))

	name := uniq("summary")
	p := createPolicy(t, dc, name, map[string]string{}, []string{"hf://org/m@main"}, nil)
	writeNode(t, dc, p, "n1", policy.NodeReady)
	writeNode(t, dc, p, "n2", policy.NodeFetching)
	writeNode(t, dc, p, "n3", policy.NodeFailed)

	s1 := startSummarizer(t, e.Config, "n1", "election")
	s2 := startSummarizer(t, e.Config, "n2", "election")
	counts := func(n, r, f int32) func(view) bool {
		return func(v view) bool {
			return v.Status.NodeCount == n && v.Status.ReadyNodes == r && v.Status.FailedNodes == f
		}
	}
	eventually(t, dc, name, "3 nodes, 1 ready, 1 failed", counts(3, 1, 1))
	leader, other := s1, s2
	if s2.leading(t) {
		leader, other = s2, s1
	}
	assert.True(t, leader.leading(t))
	assert.False(t, other.leading(t), "one leader")
	assert.Positive(t, leader.writes(t))
	assert.Zero(t, other.writes(t), "only the leader writes the counts")

	// A change is counted; a second apply of the same status is no change.
	writeNode(t, dc, p, "n2", policy.NodeReady)
	eventually(t, dc, name, "2 ready", counts(3, 2, 1))
	assert.Zero(t, other.writes(t))

	// The leader stops (and gives the Lease up): the other takes over.
	leader.stop()
	writeNode(t, dc, p, "n3", policy.NodeReady)
	eventually(t, dc, name, "3 ready, counted by the new leader", counts(3, 3, 0))
	assert.True(t, other.leading(t))
	assert.Positive(t, other.writes(t))

	// A node's object deleted: counted out.
	require.NoError(t, policy.DeleteNodeStatus(t.Context(), dc, name, "n1"))
	eventually(t, dc, name, "2 nodes", counts(2, 2, 0))

	// The policy deleted: the garbage collector deletes its nodes' objects.
	require.NoError(t, dc.Resource(policy.GVR).Delete(t.Context(), name, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool {
		list, err := dc.Resource(policy.NodeGVR).List(t.Context(), metav1.ListOptions{LabelSelector: policy.PolicyLabel + "=" + name})
		require.NoError(t, err)
		return len(list.Items) == 0
	}, time.Minute, 100*time.Millisecond, "the nodes' objects garbage-collected")
	_, err := dc.Resource(policy.NodeGVR).Get(t.Context(), policy.NodeObjectName(name, "n2"), metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "%v", err)
}

// cutOff is a RoundTripper that fails every request once cut, as a node
// cut off from the API server sees it.
type cutOff struct {
	cut  atomic.Bool
	next http.RoundTripper
}

func (c *cutOff) RoundTrip(r *http.Request) (*http.Response, error) {
	if c.cut.Load() {
		return nil, errors.New("cut off from the API server")
	}
	return c.next.RoundTrip(r)
}

// summaryServer starts an API server of the test's own, with the CRDs and
// the Leases' namespace, and a policy selecting every node, named after
// prefix.
func summaryServer(t *testing.T, prefix string) (*kubetest.Env, dynamic.Interface, *policy.PrefetchPolicy) {
	t.Helper()
	kubetest.Require(t)
	e := kubetest.NewT(t, kubeConfig)
	dc := dynamic.NewForConfigOrDie(e.Config)
	require.NoError(t, policy.InstallCRD(t.Context(), dc))
	require.NoError(t, e.EnsureNamespace(t.Context(), leaseNamespace))
	return e, dc, createPolicy(t, dc, uniq(prefix), map[string]string{}, []string{"hf://org/m@main"}, nil)
}

// TestSummarizerLeaderCutOff: a leader that can no longer reach the API
// server cannot renew, nor give the Lease up; once the Lease expires
// another Summarizer takes over and counts.
func TestSummarizerLeaderCutOff(t *testing.T) {
	e, dc, p := summaryServer(t, "cutoff")
	name := p.Name
	writeNode(t, dc, p, "n1", policy.NodeFetching)

	// Short timings, so that the Lease expires soon after the cut.
	cfg := summaryConfig("cutoff", slog.New(slog.DiscardHandler), nil)
	cfg.LeaseDuration, cfg.RenewDeadline, cfg.RetryPeriod = 4*time.Second, 3*time.Second, 500*time.Millisecond
	links := []*cutOff{{}, {}}
	var ss []*summarizer
	for i, link := range links {
		rc := rest.CopyConfig(e.Config)
		rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { link.next = rt; return link })
		ss = append(ss, startSummarizerWith(t, rc, fmt.Sprintf("n%d", i+1), cfg))
	}
	eventually(t, dc, name, "1 node counted", func(v view) bool { return v.Status.NodeCount == 1 })
	leader := slices.IndexFunc(ss, func(s *summarizer) bool { return s.leading(t) })
	require.GreaterOrEqual(t, leader, 0, "a leader")
	other := ss[1-leader]

	links[leader].cut.Store(true)
	require.Eventually(t, func() bool { return other.leading(t) }, time.Minute, 100*time.Millisecond, "the other elected")
	writeNode(t, dc, p, "n1", policy.NodeReady)
	eventually(t, dc, name, "ready, counted by the new leader", func(v view) bool { return v.Status.ReadyNodes == 1 })
	assert.Positive(t, other.writes(t))
	require.Eventually(t, func() bool { return !ss[leader].leading(t) }, time.Minute, 100*time.Millisecond, "the cut-off leader steps down")
}

// leaseReads counts an agent's requests for Leases.
type leaseReads struct {
	n    atomic.Int64
	next http.RoundTripper
}

func (l *leaseReads) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.Contains(r.URL.Path, "/leases") {
		l.n.Add(1)
	}
	return l.next.RoundTrip(r)
}

// TestSummarizerCandidates: only candidates campaign. One that is not a
// candidate reads no Lease and never leads, even with the Lease free; one
// that stops being a candidate while it campaigns stops; one that becomes
// one takes the Lease.
func TestSummarizerCandidates(t *testing.T) {
	e, dc, p := summaryServer(t, "candidates")
	name := p.Name
	writeNode(t, dc, p, "n1", policy.NodeReady)

	var candidate [2]atomic.Bool
	candidate[1].Store(true)
	reads := &leaseReads{}
	var ss []*summarizer
	for i := range candidate {
		cfg := summaryConfig("candidates", slog.New(slog.DiscardHandler), nil)
		cfg.Candidate = candidate[i].Load
		rc := rest.CopyConfig(e.Config)
		if i == 0 {
			rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { reads.next = rt; return reads })
		}
		ss = append(ss, startSummarizerWith(t, rc, fmt.Sprintf("n%d", i+1), cfg))
	}
	eventually(t, dc, name, "counted by n2", func(v view) bool { return v.Status.NodeCount == 1 })
	require.True(t, ss[1].leading(t))
	require.False(t, ss[0].leading(t))
	require.Zero(t, reads.n.Load(), "not a candidate: no Lease read")
	require.Zero(t, metricValue(t, ss[0].reg, "weightd_policy_summary_candidate"))
	require.Equal(t, 1.0, metricValue(t, ss[1].reg, "weightd_policy_summary_candidate"))

	// n1 campaigns while n2 leads, then stops being a candidate; n2 goes,
	// giving the Lease up: n1 does not take it.
	candidate[0].Store(true)
	require.Eventually(t, func() bool { return reads.n.Load() > 0 }, 10*time.Second, 20*time.Millisecond, "a candidate reads the Lease")
	candidate[0].Store(false)
	time.Sleep(3 * summaryConfig("", nil, nil).RetryPeriod) // its campaign ends within one
	ss[1].stop()
	before := reads.n.Load()
	require.Never(t, func() bool { return ss[0].leading(t) }, 2*time.Second, 50*time.Millisecond, "no longer a candidate, it does not take the free Lease")
	require.Equal(t, before, reads.n.Load(), "nor reads it")

	candidate[0].Store(true)
	require.Eventually(t, func() bool { return ss[0].leading(t) }, 10*time.Second, 20*time.Millisecond, "a candidate again, it takes the Lease")
}
