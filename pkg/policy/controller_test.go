package policy_test

import (
	"context"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	ggcrv1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/genmodel/genmodeltest"
	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/policy"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/source/oci"
)

var (
	_ policy.Pinner = (*cache.Store)(nil)
	_ policy.Job    = (*prefetch.Job)(nil)
)

// kubeConfig is how the tests start API servers: on loopback, without the
// endpoint reconciler (which refuses a loopback advertise address).
var kubeConfig = kubetest.Config{APIServerArgs: []string{"--endpoint-reconciler-type=none"}}

// env is one API server shared by the tests of this package (each test uses
// its own node and policy names), started by the first test that needs it.
var (
	envOnce sync.Once
	env     *kubetest.Env
	envErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if env != nil {
		env.Close()
	}
	os.Exit(code)
}

// kube returns the shared API server, with the CRD installed, skipping the
// test without one (failing under CI=true).
func kube(t *testing.T) (*kubetest.Env, kubernetes.Interface, dynamic.Interface) {
	t.Helper()
	kubetest.Require(t)
	envOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		e, err := kubetest.Start(ctx, kubeConfig)
		if err != nil {
			envErr = fmt.Errorf("starting the API server: %w", err)
			return
		}
		env = e
		if envErr = policy.InstallCRD(ctx, dynamic.NewForConfigOrDie(e.Config)); envErr == nil {
			envErr = e.EnsureNamespace(ctx, leaseNamespace)
		}
	})
	require.NoError(t, envErr)
	return env, kubernetes.NewForConfigOrDie(env.Config), dynamic.NewForConfigOrDie(env.Config)
}

// leaseNamespace holds the Leases of the tests' Summarizers; the agents of
// the tests share testLease.
const (
	leaseNamespace = "weightd-system"
	testLease      = "policy-tests"
)

var seq atomic.Int64

// uniq makes a name unique in this process, so that tests can run more than
// once (-count) against the shared API server.
func uniq(s string) string { return fmt.Sprintf("%s-%d", s, seq.Add(1)) }

// startOrigin serves a generated model until the test ends and returns its
// manifest reference.
func startOrigin(t *testing.T, spec genmodel.Spec) (string, *genmodel.Manifest) {
	t.Helper()
	o := genmodeltest.Start(t, spec)
	return o.Ref(), o.Manifest
}

// agent is what one node runs: a cache, a prefetch queue, the controller
// and the Summarizer.
type agent struct {
	node  string
	store *cache.Store
	stop  func()
}

// startAgent starts node's agent, whose Summarizer campaigns for lease.
func startAgent(t *testing.T, rc *rest.Config, node, lease string) *agent {
	t.Helper()
	kc, dc := kubernetes.NewForConfigOrDie(rc), dynamic.NewForConfigOrDie(rc)
	store, err := cache.Open(t.TempDir(), cache.WithChunkSize(64<<10))
	require.NoError(t, err)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	if testing.Verbose() {
		log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	src := source.Sources{ref.KindHTTP: httpsource.New(nil), ref.KindOCI: oci.New()}
	q := prefetch.NewQueue(store, src, prefetch.WithResolveRetries(1, 0), prefetch.WithLogger(log))
	c, err := policy.New(node, kc, dc, policy.FromQueue(q), store, policy.Config{
		Debounce:  200 * time.Millisecond,
		RetryBase: time.Hour,
		Logger:    log,
	})
	require.NoError(t, err)
	s, err := policy.NewSummarizer(node, kc, dc, metadata.NewForConfigOrDie(rc), summaryConfig(lease, log, nil))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { assert.NoError(t, q.Run(ctx)) })
	wg.Go(func() { assert.NoError(t, c.Run(ctx)) })
	wg.Go(func() { assert.NoError(t, s.Run(ctx)) })
	var once sync.Once
	a := &agent{node: node, store: store, stop: func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			store.Close()
		})
	}}
	t.Cleanup(a.stop)
	return a
}

// summaryConfig is the tests' Summarizer configuration: Lease lease, short
// timings.
func summaryConfig(lease string, log *slog.Logger, reg prometheus.Registerer) policy.SummaryConfig {
	return policy.SummaryConfig{
		Interval:       100 * time.Millisecond,
		LeaseNamespace: leaseNamespace,
		LeaseName:      lease,
		LeaseDuration:  15 * time.Second,
		RenewDeadline:  10 * time.Second,
		RetryPeriod:    250 * time.Millisecond,
		Logger:         log,
		Registerer:     reg,
	}
}

// pinnedBy lists the blobs pinned by owner.
func (a *agent) pinnedBy(owner string) []digest.Digest {
	var out []digest.Digest
	for _, info := range a.store.List() {
		if slices.Contains(info.Pins, owner) {
			out = append(out, info.Digest)
		}
	}
	return out
}

func createPolicy(t *testing.T, dc dynamic.Interface, name string, sel map[string]string, models, images []string) *policy.PrefetchPolicy {
	t.Helper()
	p := &policy.PrefetchPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       policy.Spec{NodeSelector: &metav1.LabelSelector{MatchLabels: sel}, Models: models, Images: images},
	}
	u, err := policy.ToUnstructured(p)
	require.NoError(t, err)
	u, err = dc.Resource(policy.GVR).Create(t.Context(), u, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = dc.Resource(policy.GVR).Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	got, err := policy.FromUnstructured(u)
	require.NoError(t, err)
	return got
}

// view is a policy and the status of each of its nodes, by node name.
type view struct {
	*policy.PrefetchPolicy
	nodes map[string]policy.NodeStatus
}

// entry is node's status of the policy, if it wrote one.
func (v view) entry(node string) (policy.NodeStatus, bool) {
	n, ok := v.nodes[node]
	return n, ok
}

// getPolicy reads the policy and its PrefetchPolicyNodes (by label).
func getPolicy(t *testing.T, dc dynamic.Interface, name string) view {
	t.Helper()
	u, err := dc.Resource(policy.GVR).Get(t.Context(), name, metav1.GetOptions{})
	require.NoError(t, err)
	p, err := policy.FromUnstructured(u)
	require.NoError(t, err)
	list, err := dc.Resource(policy.NodeGVR).List(t.Context(), metav1.ListOptions{LabelSelector: policy.PolicyLabel + "=" + policy.LabelValue(name)})
	require.NoError(t, err)
	v := view{PrefetchPolicy: p, nodes: make(map[string]policy.NodeStatus)}
	for i := range list.Items {
		n, err := policy.NodeFromUnstructured(&list.Items[i])
		require.NoError(t, err)
		assert.Equal(t, policy.NodeObjectName(name, n.Status.Name), n.Name)
		v.nodes[n.Status.Name] = n.Status
	}
	return v
}

// eventually polls cond until it holds, failing the test after a minute
// with the last policy seen.
func eventually(t *testing.T, dc dynamic.Interface, name, what string, cond func(p view) bool) view {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		p := getPolicy(t, dc, name)
		if cond(p) {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("policy %s: timed out waiting for %s; status: %+v, nodes: %+v", name, what, p.Status, p.nodes)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func setLabels(t *testing.T, kc kubernetes.Interface, node string, labels map[string]string) {
	t.Helper()
	n, err := kc.CoreV1().Nodes().Get(t.Context(), node, metav1.GetOptions{})
	require.NoError(t, err)
	n.Labels = labels
	_, err = kc.CoreV1().Nodes().Update(t.Context(), n, metav1.UpdateOptions{})
	require.NoError(t, err)
}

func fileDigests(m *genmodel.Manifest) []digest.Digest {
	var ds []digest.Digest
	for _, f := range m.Files {
		if !slices.Contains(ds, f.Digest()) {
			ds = append(ds, f.Digest())
		}
	}
	return ds
}

// TestPolicyLifecycle follows one node through a policy's life: selected
// (fetched, pinned, reported ready), deselected by a label change (unpinned,
// entry removed), selected again, and the policy deleted (unpinned).
func TestPolicyLifecycle(t *testing.T) {
	t.Parallel()
	e, kc, dc := kube(t)
	ref, m := startOrigin(t, genmodel.Spec{Name: "org/lifecycle", Files: 4, TotalBytes: 1<<20 + 3, Seed: 7})
	node, name := uniq("life-1"), uniq("life")
	_, err := e.CreateNode(t.Context(), node, map[string]string{"pool": "life"})
	require.NoError(t, err)
	a := startAgent(t, e.Config, node, testLease)
	p := createPolicy(t, dc, name, map[string]string{"pool": "life"}, []string{ref}, nil)
	owner := policy.PinOwner(name)

	ready := func(p view) bool {
		n, ok := p.entry(node)
		return ok && n.State == policy.NodeReady && p.Status.ReadyNodes == 1
	}
	got := eventually(t, dc, name, "the node's entry ready", ready)
	n, _ := got.entry(node)
	assert.Equal(t, []string{ref}, n.Ready)
	assert.Empty(t, n.Fetching)
	assert.Empty(t, n.Failed)
	assert.Equal(t, m.TotalBytes(), n.Bytes)
	assert.Equal(t, p.Generation, n.ObservedGeneration)
	assert.WithinDuration(t, time.Now(), n.Updated.Time, time.Minute)
	assert.Equal(t, int32(1), got.Status.NodeCount)
	assert.Equal(t, int32(0), got.Status.FailedNodes)
	assert.ElementsMatch(t, fileDigests(m), a.pinnedBy(owner), "every file of the model pinned")

	// The node's object: written under its field manager only, owned by
	// the policy.
	u, err := dc.Resource(policy.NodeGVR).Get(t.Context(), policy.NodeObjectName(name, node), metav1.GetOptions{})
	require.NoError(t, err)
	var managers []string
	for _, mf := range u.GetManagedFields() {
		managers = append(managers, mf.Manager)
	}
	assert.Equal(t, []string{policy.FieldManager(node)}, managers)
	require.Len(t, u.GetOwnerReferences(), 1)
	assert.Equal(t, p.UID, u.GetOwnerReferences()[0].UID)
	assert.Equal(t, map[string]string{policy.PolicyLabel: name, policy.NodeLabel: node}, u.GetLabels())

	// kubectl answers from the printer columns, and selects by state.
	if kubectl, err := exec.LookPath("kubectl"); err == nil {
		get := func(args ...string) []string {
			out, err := exec.CommandContext(t.Context(), kubectl, append([]string{"--kubeconfig", e.Kubeconfig, "get"}, args...)...).CombinedOutput()
			require.NoError(t, err, "%s", out)
			return strings.Split(strings.TrimSpace(string(out)), "\n")
		}
		lines := get("pp", name)
		require.Len(t, lines, 2, "%s", lines)
		assert.Equal(t, []string{"NAME", "NODES", "READY", "FAILED", "AGE"}, strings.Fields(lines[0]))
		assert.Equal(t, []string{name, "1", "1", "0"}, strings.Fields(lines[1])[:4])
		lines = get("ppn", "-l", policy.PolicyLabel+"="+name, "--field-selector", "status.state=Ready")
		require.Len(t, lines, 2, "%s", lines)
		assert.Equal(t, []string{"NAME", "NODE", "STATE", "READY", "FAILED", "AGE"}, strings.Fields(lines[0]))
		assert.Equal(t, []string{policy.NodeObjectName(name, node), node, "Ready", "1", "0"}, strings.Fields(lines[1])[:5])
		lines = get("ppn", "-l", policy.PolicyLabel+"="+name, "--field-selector", "status.state=Failed")
		assert.Equal(t, []string{"No resources found"}, lines)
	}

	// The node's labels change: no longer selected.
	setLabels(t, kc, node, map[string]string{"pool": "other"})
	got = eventually(t, dc, name, "the node's entry removed", func(p view) bool {
		_, ok := p.entry(node)
		return !ok && p.Status.NodeCount == 0
	})
	assert.Equal(t, int32(0), got.Status.ReadyNodes)
	require.Eventually(t, func() bool { return len(a.pinnedBy(owner)) == 0 }, 10*time.Second, 20*time.Millisecond, "unpinned")
	for _, d := range fileDigests(m) {
		_, err := a.store.Stat(d)
		assert.NoError(t, err, "unpinned, not deleted")
	}

	// Selected again: a cache hit, pinned again.
	setLabels(t, kc, node, map[string]string{"pool": "life", "extra": "x"})
	eventually(t, dc, name, "the node's entry ready again", ready)
	require.Eventually(t, func() bool { return len(a.pinnedBy(owner)) == len(fileDigests(m)) }, 10*time.Second, 20*time.Millisecond)

	// Deleted: unpinned.
	require.NoError(t, dc.Resource(policy.GVR).Delete(t.Context(), name, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return len(a.pinnedBy(owner)) == 0 }, 10*time.Second, 20*time.Millisecond, "unpinned")
}

// TestPolicyFailures: content that does not exist and malformed references
// are listed under failed with their reasons, with a Warning Event each,
// and what exists still becomes ready and pinned.
func TestPolicyFailures(t *testing.T) {
	t.Parallel()
	e, kc, dc := kube(t)
	ref, m := startOrigin(t, genmodel.Spec{Name: "org/partial", Files: 2, TotalBytes: 64 << 10, Seed: 8})
	missing := strings.TrimSuffix(ref, genmodel.ManifestName) + "nothing/model.json"
	node, name := uniq("fail-1"), uniq("fail")
	_, err := e.CreateNode(t.Context(), node, map[string]string{"pool": "fail"})
	require.NoError(t, err)
	a := startAgent(t, e.Config, node, testLease)
	createPolicy(t, dc, name, map[string]string{"pool": "fail"},
		[]string{ref, missing, "https://host.example/dir/?X-Amz-Signature=secret"},
		[]string{"Not/A:Valid:Image"})

	// The counts are written after the entry, by the first-ranked agent
	// after its delay: wait for both.
	got := eventually(t, dc, name, "three failures, one failed node", func(p view) bool {
		n, ok := p.entry(node)
		return ok && len(n.Failed) == 3 && len(n.Ready) == 1 && p.Status.FailedNodes == 1
	})
	n, _ := got.entry(node)
	assert.Equal(t, policy.NodeFailed, n.State)
	assert.Equal(t, []string{ref}, n.Ready)
	reasons := make(map[string]string)
	for _, f := range n.Failed {
		reasons[f.Ref] = f.Reason
	}
	assert.Contains(t, reasons[missing], "404")
	assert.Contains(t, reasons["https://host.example/dir/?REDACTED"], "must name a file")
	assert.Contains(t, reasons["Not/A:Valid:Image"], "parsing image")
	assert.NotContains(t, fmt.Sprint(got.Status), "secret")
	assert.ElementsMatch(t, fileDigests(m), a.pinnedBy(policy.PinOwner(name)), "what exists is pinned")

	// One Warning Event per failure, on the policy, from this node.
	var events []corev1.Event
	require.Eventually(t, func() bool {
		list, err := kc.CoreV1().Events(metav1.NamespaceDefault).List(t.Context(), metav1.ListOptions{
			FieldSelector: fields.Set{"involvedObject.name": name, "involvedObject.kind": policy.Kind}.String(),
		})
		require.NoError(t, err)
		events = list.Items
		return len(events) >= 3
	}, 30*time.Second, 100*time.Millisecond)
	byReason := make(map[string]int)
	for _, ev := range events {
		assert.Equal(t, corev1.EventTypeWarning, ev.Type)
		assert.Equal(t, types.UID(got.UID), ev.InvolvedObject.UID)
		assert.Equal(t, policy.APIVersion, ev.InvolvedObject.APIVersion)
		assert.Equal(t, node, ev.Source.Host)
		assert.Contains(t, ev.Message, "node "+node)
		assert.NotContains(t, ev.Message, "secret")
		byReason[ev.Reason]++
	}
	assert.Equal(t, map[string]int{policy.ReasonFailed: 1, policy.ReasonInvalid: 2}, byReason)
}

// TestPolicyManyNodes: agents of several nodes report on the same policies
// at the same time, each in its own object; the Summarizer counts them.
func TestPolicyManyNodes(t *testing.T) {
	t.Parallel()
	e, kc, dc := kube(t)
	refA, _ := startOrigin(t, genmodel.Spec{Name: "org/many-a", Files: 3, TotalBytes: 256 << 10, Seed: 9})
	refB, _ := startOrigin(t, genmodel.Spec{Name: "org/many-b", Files: 2, TotalBytes: 128 << 10, Seed: 10})
	nodes := []string{uniq("many-1"), uniq("many-2"), uniq("many-3")}
	pa, pb := uniq("many-a"), uniq("many-b")
	for _, n := range nodes {
		_, err := e.CreateNode(t.Context(), n, map[string]string{"pool": "many"})
		require.NoError(t, err)
	}
	// Both policies first, then all agents at once: their writes race.
	createPolicy(t, dc, pa, map[string]string{"pool": "many"}, []string{refA}, nil)
	createPolicy(t, dc, pb, map[string]string{"pool": "many"}, []string{refA, refB}, nil)
	agents := make([]*agent, len(nodes))
	for i, n := range nodes {
		agents[i] = startAgent(t, e.Config, n, testLease)
	}
	for _, name := range []string{pa, pb} {
		got := eventually(t, dc, name, "every node ready", func(p view) bool {
			for _, n := range nodes {
				if e, ok := p.entry(n); !ok || e.State != policy.NodeReady {
					return false
				}
			}
			return p.Status.ReadyNodes == int32(len(nodes))
		})
		assert.Len(t, got.nodes, len(nodes))
		assert.Equal(t, int32(len(nodes)), got.Status.NodeCount)
		for _, a := range agents {
			assert.NotEmpty(t, a.pinnedBy(policy.PinOwner(name)))
		}
	}

	// One node leaves the pool: only its entry goes.
	setLabels(t, kc, nodes[1], nil)
	got := eventually(t, dc, pb, "one entry fewer", func(p view) bool {
		return len(p.nodes) == 2 && p.Status.NodeCount == 2 && p.Status.ReadyNodes == 2
	})
	_, ok := got.entry(nodes[1])
	assert.False(t, ok)
	require.Eventually(t, func() bool { return len(agents[1].pinnedBy(policy.PinOwner(pb))) == 0 }, 10*time.Second, 20*time.Millisecond)
	assert.NotEmpty(t, agents[0].pinnedBy(policy.PinOwner(pb)))

	// A node deleted with its agent (a scale-down): its status stays, but
	// is no longer counted; deleted on its behalf, it is gone.
	agents[2].stop()
	require.NoError(t, kc.CoreV1().Nodes().Delete(t.Context(), nodes[2], metav1.DeleteOptions{}))
	got = eventually(t, dc, pb, "the deleted node not counted", func(p view) bool {
		return p.Status.NodeCount == 1 && p.Status.ReadyNodes == 1
	})
	_, ok = got.entry(nodes[2])
	assert.True(t, ok, "its status stays: no agent may delete another node's")
	require.NoError(t, policy.DeleteNodeStatus(t.Context(), dc, pb, nodes[2]))
	require.NoError(t, policy.DeleteNodeStatus(t.Context(), dc, "no-such-policy", nodes[2]))
	got = eventually(t, dc, pb, "the deleted node's status gone", func(p view) bool {
		return len(p.nodes) == 1 && p.Status.NodeCount == 1 && p.Status.ReadyNodes == 1
	})
	_, ok = got.entry(nodes[0])
	assert.True(t, ok)
}

// TestPolicyAgentRestart: pins survive the agent; a policy deleted while it
// was down is unpinned when it comes back.
func TestPolicyAgentRestart(t *testing.T) {
	t.Parallel()
	e, kc, dc := kube(t)
	ref, m := startOrigin(t, genmodel.Spec{Name: "org/restart", Files: 2, TotalBytes: 64 << 10, Seed: 11})
	node, name := uniq("restart-1"), uniq("restart")
	_, err := e.CreateNode(t.Context(), node, map[string]string{"pool": "restart"})
	require.NoError(t, err)
	root := t.TempDir()
	run := func() (*policy.Controller, *cache.Store, func()) {
		store, err := cache.Open(root)
		require.NoError(t, err)
		q := prefetch.NewQueue(store, httpsource.New(nil))
		c, err := policy.New(node, kc, dc, policy.FromQueue(q), store, policy.Config{Debounce: 100 * time.Millisecond})
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		wg.Go(func() { assert.NoError(t, q.Run(ctx)) })
		wg.Go(func() { assert.NoError(t, c.Run(ctx)) })
		return c, store, func() { cancel(); wg.Wait(); store.Close() }
	}
	_, store, stop := run()
	createPolicy(t, dc, name, map[string]string{"pool": "restart"}, []string{ref}, nil)
	eventually(t, dc, name, "ready", func(p view) bool {
		n, ok := p.entry(node)
		return ok && n.State == policy.NodeReady
	})
	a := &agent{store: store}
	require.Eventually(t, func() bool { return len(a.pinnedBy(policy.PinOwner(name))) == len(fileDigests(m)) }, 10*time.Second, 20*time.Millisecond)
	stop()

	require.NoError(t, dc.Resource(policy.GVR).Delete(t.Context(), name, metav1.DeleteOptions{}))
	_, store, stop = run()
	defer stop()
	a = &agent{store: store}
	assert.Len(t, a.pinnedBy(policy.PinOwner(name)), len(fileDigests(m)), "pins survived the restart")
	require.Eventually(t, func() bool { return len(a.pinnedBy(policy.PinOwner(name))) == 0 }, 20*time.Second, 20*time.Millisecond,
		"a policy deleted while the agent was down is unpinned")
}

// TestCRDValidation: the API server rejects malformed policies with 422.
func TestCRDValidation(t *testing.T) {
	t.Parallel()
	_, _, dc := kube(t)
	valid := func() map[string]any {
		return map[string]any{
			"nodeSelector": map[string]any{"matchLabels": map[string]any{"pool": "a"}},
			"models":       []any{"hf://org/m@main"},
		}
	}
	many := make([]any, policy.MaxModels+1)
	for i := range many {
		many[i] = fmt.Sprintf("hf://org/m%d@main", i)
	}
	tests := []struct {
		name   string
		mutate func(spec map[string]any)
		field  string
	}{
		{"no selector", func(s map[string]any) { delete(s, "nodeSelector") }, "nodeSelector"},
		{"nothing to keep", func(s map[string]any) { delete(s, "models") }, "at least one model or image"},
		{"unknown scheme", func(s map[string]any) { s["models"] = []any{"ftp://host/m"} }, "models[0]"},
		{"spaces", func(s map[string]any) { s["models"] = []any{"hf://org/m @main"} }, "models[0]"},
		{"too long", func(s map[string]any) { s["models"] = []any{"https://h/" + strings.Repeat("a", 5000)} }, "models[0]"},
		{"too many", func(s map[string]any) { s["models"] = many }, "models"},
		{"duplicates", func(s map[string]any) { s["models"] = []any{"hf://a/b@main", "hf://a/b@main"} }, "models[1]"},
		{"empty image", func(s map[string]any) { s["images"] = []any{""} }, "images[0]"},
		{"pin not a bool", func(s map[string]any) { s["pin"] = "yes" }, "pin"},
		{"bad operator", func(s map[string]any) {
			s["nodeSelector"] = map[string]any{"matchExpressions": []any{map[string]any{"key": "a", "operator": "Near"}}}
		}, "operator"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := valid()
			tt.mutate(spec)
			u, err := policy.ToUnstructured(&policy.PrefetchPolicy{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("invalid-%d", i)}})
			require.NoError(t, err)
			u.Object["spec"] = spec
			_, err = dc.Resource(policy.GVR).Create(t.Context(), u, metav1.CreateOptions{})
			require.Error(t, err)
			assert.True(t, apierrors.IsInvalid(err), "want 422, got %v", err)
			var se apierrors.APIStatus
			require.ErrorAs(t, err, &se)
			assert.Equal(t, int32(422), se.Status().Code)
			assert.Contains(t, err.Error(), tt.field)
		})
	}

	// The valid one passes, and pin defaults to true.
	name := uniq("valid")
	u, err := policy.ToUnstructured(&policy.PrefetchPolicy{ObjectMeta: metav1.ObjectMeta{Name: name}})
	require.NoError(t, err)
	u.Object["spec"] = valid()
	u, err = dc.Resource(policy.GVR).Create(t.Context(), u, metav1.CreateOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = dc.Resource(policy.GVR).Delete(context.Background(), name, metav1.DeleteOptions{}) })
	p, err := policy.FromUnstructured(u)
	require.NoError(t, err)
	require.NotNil(t, p.Spec.Pin)
	assert.True(t, *p.Spec.Pin)

	// A node's status with an unknown state is refused too.
	obj, err := policy.NodeStatusObject(p, policy.NodeStatus{Name: "n", State: "Bogus"})
	require.NoError(t, err)
	_, err = dc.Resource(policy.NodeGVR).Apply(t.Context(), obj.GetName(), obj, metav1.ApplyOptions{FieldManager: "test"})
	assert.True(t, apierrors.IsInvalid(err), "want 422, got %v", err)
}

// TestPolicyAPIServerRestart: the agent rides out an API server restart (its
// own, so the other tests' server stays up): the cache keeps its content,
// and once the server is back the agent sees a change to the policy and
// reports it.
func TestPolicyAPIServerRestart(t *testing.T) {
	kubetest.Require(t)
	e := kubetest.NewT(t, kubeConfig)
	dc := dynamic.NewForConfigOrDie(e.Config)
	require.NoError(t, policy.InstallCRD(t.Context(), dc))
	require.NoError(t, e.EnsureNamespace(t.Context(), leaseNamespace))
	ref1, m1 := startOrigin(t, genmodel.Spec{Name: "org/restart-a", Files: 2, TotalBytes: 64 << 10, Seed: 12})
	ref2, _ := startOrigin(t, genmodel.Spec{Name: "org/restart-b", Files: 2, TotalBytes: 64 << 10, Seed: 13})
	node, name := uniq("apirestart-1"), uniq("apirestart")
	_, err := e.CreateNode(t.Context(), node, map[string]string{"pool": "r"})
	require.NoError(t, err)
	a := startAgent(t, e.Config, node, testLease)
	createPolicy(t, dc, name, map[string]string{"pool": "r"}, []string{ref1}, nil)
	eventually(t, dc, name, "ready", func(p view) bool {
		n, ok := p.entry(node)
		return ok && n.State == policy.NodeReady
	})

	require.NoError(t, e.StopAPIServer())
	time.Sleep(2 * time.Second) // the informers notice and retry
	for _, d := range fileDigests(m1) {
		_, err := a.store.Stat(d)
		assert.NoError(t, err, "the cache serves on without the API server")
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	require.NoError(t, e.StartAPIServer(ctx))

	patch := fmt.Appendf(nil, `{"spec":{"models":[%q,%q]}}`, ref1, ref2)
	_, err = dc.Resource(policy.GVR).Patch(t.Context(), name, types.MergePatchType, patch, metav1.PatchOptions{})
	require.NoError(t, err)
	got := eventually(t, dc, name, "both models ready at the new generation", func(p view) bool {
		n, ok := p.entry(node)
		return ok && n.State == policy.NodeReady && n.ObservedGeneration == p.Generation && len(n.Ready) == 2 &&
			p.Status.ReadyNodes == 1
	})
	n, _ := got.entry(node)
	assert.Equal(t, []string{ref1, ref2}, n.Ready)
}

// TestPolicyImage: an image named as a pod spec names it is normalised,
// fetched from its registry and every blob of it (manifest, config,
// layers) pinned.
func TestPolicyImage(t *testing.T) {
	t.Parallel()
	e, _, dc := kube(t)
	srv := httptest.NewServer(registry.New(registry.Logger(stdlog.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	img, err := random.Image(100<<10, 3)
	require.NoError(t, err)
	tag, err := name.NewTag(host + "/team/app:v1")
	require.NoError(t, err)
	require.NoError(t, remote.Write(tag, img))
	want := []digest.Digest{}
	for _, h := range []func() (ggcrv1.Hash, error){img.Digest, img.ConfigName} {
		d, err := h()
		require.NoError(t, err)
		want = append(want, digest.Digest(d.String()))
	}
	layers, err := img.Layers()
	require.NoError(t, err)
	for _, l := range layers {
		d, err := l.Digest()
		require.NoError(t, err)
		want = append(want, digest.Digest(d.String()))
	}

	node, pname := uniq("image-1"), uniq("image")
	_, err = e.CreateNode(t.Context(), node, map[string]string{"pool": "image"})
	require.NoError(t, err)
	a := startAgent(t, e.Config, node, testLease)
	createPolicy(t, dc, pname, map[string]string{"pool": "image"}, nil, []string{host + "/team/app:v1"})
	got := eventually(t, dc, pname, "the image ready", func(p view) bool {
		n, ok := p.entry(node)
		return ok && n.State == policy.NodeReady
	})
	n, _ := got.entry(node)
	assert.Equal(t, []string{"oci://" + host + "/team/app:v1"}, n.Ready, "normalised as the kubelet does")
	assert.Positive(t, n.Bytes)
	require.Eventually(t, func() bool { return len(a.pinnedBy(policy.PinOwner(pname))) == len(want) }, 10*time.Second, 20*time.Millisecond)
	assert.ElementsMatch(t, want, a.pinnedBy(policy.PinOwner(pname)))
}

// TestPolicyLeastPrivilege: the agent's ClusterRole and Role in
// deploy/daemonset (rbac.yaml) are enough for the controller and the
// Summarizer: they run as the agent's service account, report ready, record
// the Events and take the Lease.
func TestPolicyLeastPrivilege(t *testing.T) {
	t.Parallel()
	e, _, adminDC := kube(t)
	raw, err := os.ReadFile(filepath.Join("..", "..", "deploy", "daemonset", "rbac.yaml"))
	if os.IsNotExist(err) {
		t.Skip("deploy/daemonset/rbac.yaml not there")
	}
	require.NoError(t, err)
	var sa string
	for _, doc := range strings.Split(string(raw), "\n---") {
		js, err := utilyaml.ToJSON([]byte(doc))
		require.NoError(t, err)
		u := &unstructured.Unstructured{}
		require.NoError(t, u.UnmarshalJSON(js))
		var res string
		switch u.GetKind() {
		case "ClusterRole":
			res = "clusterroles"
		case "ClusterRoleBinding":
			res = "clusterrolebindings"
			subjects, _, _ := unstructured.NestedSlice(u.Object, "subjects")
			require.NotEmpty(t, subjects)
			s := subjects[0].(map[string]any)
			sa = fmt.Sprintf("system:serviceaccount:%s:%s", s["namespace"], s["name"])
		case "Role":
			res = "roles"
		case "RoleBinding":
			res = "rolebindings"
		default:
			continue
		}
		gvr := schema.GroupVersionResource{Group: "rbac.authorization.k8s.io", Version: "v1", Resource: res}
		_, err = adminDC.Resource(gvr).Namespace(u.GetNamespace()).Apply(t.Context(), u.GetName(), u, metav1.ApplyOptions{FieldManager: "test", Force: true})
		require.NoError(t, err)
	}
	require.NotEmpty(t, sa, "rbac.yaml binds the role to a service account")

	cfg := rest.CopyConfig(e.Config)
	ns := strings.Split(sa, ":")[2]
	cfg.Impersonate = rest.ImpersonationConfig{UserName: sa,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}
	kc, dc := kubernetes.NewForConfigOrDie(cfg), dynamic.NewForConfigOrDie(cfg)
	// The API server's RBAC authorizer sees the new binding through its
	// informer, a moment after the apply.
	require.Eventually(t, func() bool {
		_, err = kc.CoreV1().Nodes().Get(t.Context(), "nobody", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}, 10*time.Second, 50*time.Millisecond, "impersonating %s", sa)
	_, err = dc.Resource(policy.GVR).Create(t.Context(), &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": policy.APIVersion, "kind": policy.Kind, "metadata": map[string]any{"name": uniq("forbidden")},
		"spec": map[string]any{"nodeSelector": map[string]any{}, "models": []any{"hf://a/b@main"}},
	}}, metav1.CreateOptions{})
	require.True(t, apierrors.IsForbidden(err), "the agent may not create policies: %v", err)

	ref, _ := startOrigin(t, genmodel.Spec{Name: "org/rbac", Files: 2, TotalBytes: 64 << 10, Seed: 14})
	node, pname := uniq("rbac-1"), uniq("rbac")
	_, err = e.CreateNode(t.Context(), node, map[string]string{"pool": "rbac"})
	require.NoError(t, err)
	// The Lease the deploy's Role names: this agent alone campaigns for it.
	lease := policy.DefaultSummaryConfig().LeaseName
	startAgent(t, cfg, node, lease)
	createPolicy(t, adminDC, pname, map[string]string{"pool": "rbac"}, []string{ref, ref + "x"}, nil)
	eventually(t, adminDC, pname, "one ready, one failed, counted", func(p view) bool {
		n, ok := p.entry(node)
		return ok && len(n.Ready) == 1 && len(n.Failed) == 1 && p.Status.FailedNodes == 1
	})
	require.Eventually(t, func() bool {
		list, err := e.Clientset().CoreV1().Events(metav1.NamespaceDefault).List(t.Context(), metav1.ListOptions{
			FieldSelector: fields.Set{"involvedObject.name": pname}.String(),
		})
		return err == nil && len(list.Items) == 1
	}, 30*time.Second, 100*time.Millisecond, "the Event recorded as the agent")
	l, err := kc.CoordinationV1().Leases(leaseNamespace).Get(t.Context(), lease, metav1.GetOptions{})
	require.NoError(t, err)
	require.NotNil(t, l.Spec.HolderIdentity)
	assert.Equal(t, node, *l.Spec.HolderIdentity, "the agent's Summarizer elected")
}
