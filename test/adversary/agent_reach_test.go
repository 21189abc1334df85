package adversary

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/tools/record"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/policy"
)

// Attack 7 of issue 21: a compromised agent uses what RBAC grants every
// agent (patch any node, any pod, any policy status, write any
// PrefetchPolicyNode, create and patch any Event) beyond what weightd
// writes. The deploy's admission policies confine
// it; each test acts as the agent of node n1 with a token bound to its pod,
// as the kubelet mounts it, on a real API server.

const (
	reachNamespace = "weightd-system"
	reachPolicy    = "gpus"
)

// reachFixture is a real API server with the deploy's service account, RBAC
// and admission policies applied, nodes n1 and n2 (tainted, labelled), pods
// w1 on n1 and w2 on n2, a PrefetchPolicy with n2's PrefetchPolicyNode, and
// clients of the agent of n1.
type reachFixture struct {
	env    *kubetest.Env
	admin  kubernetes.Interface
	adyn   dynamic.Interface
	agent  kubernetes.Interface // n1's agent
	meta   metadata.Interface   // n1's agent
	dyn    dynamic.Interface    // n1's agent
	policy *policy.PrefetchPolicy
}

var policiesGVR = schema.GroupVersionResource{Group: "weightd.io", Version: "v1alpha1", Resource: "prefetchpolicies"}

// deployObjects are the deploy files the fixture applies, and where the
// kinds they hold are served.
var (
	deployFiles = []string{"serviceaccount.yaml", "rbac.yaml", "admission-policy.yaml"}
	deployKinds = map[string]schema.GroupVersionResource{
		"ServiceAccount":                   {Version: "v1", Resource: "serviceaccounts"},
		"ClusterRole":                      {Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterroles"},
		"ClusterRoleBinding":               {Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "clusterrolebindings"},
		"Role":                             {Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "roles"},
		"RoleBinding":                      {Group: "rbac.authorization.k8s.io", Version: "v1", Resource: "rolebindings"},
		"ValidatingAdmissionPolicy":        {Group: "admissionregistration.k8s.io", Version: "v1", Resource: "validatingadmissionpolicies"},
		"ValidatingAdmissionPolicyBinding": {Group: "admissionregistration.k8s.io", Version: "v1", Resource: "validatingadmissionpolicybindings"},
	}
)

func newReachFixture(t *testing.T) *reachFixture {
	return newReachFixtureIn(t, kubetest.Config{})
}

func newReachFixtureIn(t *testing.T, kcfg kubetest.Config) *reachFixture {
	t.Helper()
	env := kubetest.NewT(t, kcfg)
	ctx := t.Context()
	f := &reachFixture{env: env, admin: env.Clientset()}
	var err error
	if f.adyn, err = dynamic.NewForConfig(env.Config); err != nil {
		t.Fatal(err)
	}
	if err := env.EnsureNamespace(ctx, reachNamespace); err != nil {
		t.Fatal(err)
	}
	if err := policy.InstallCRD(ctx, f.adyn); err != nil {
		t.Fatal(err)
	}
	for _, name := range deployFiles {
		f.applyFile(t, "../../deploy/daemonset/"+name)
	}
	for _, n := range []string{"n1", "n2"} {
		if _, err := env.CreateNode(ctx, n, map[string]string{"nvidia.com/gpu.present": "true"}); err != nil {
			t.Fatal(err)
		}
		taint := []byte(`{"spec":{"taints":[{"key":"nvidia.com/gpu","value":"present","effect":"NoSchedule"}]}}`)
		if _, err := f.admin.CoreV1().Nodes().Patch(ctx, n, types.MergePatchType, taint, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	agentPod := f.createPod(t, reachNamespace, "weightd-n1", "n1", "weightd")
	for _, p := range []struct{ name, node string }{{"w1", "n1"}, {"w2", "n2"}} {
		f.createPod(t, "default", p.name, p.node, "")
	}
	cfg, err := env.ServiceAccountConfig(ctx, reachNamespace, "weightd", agentPod)
	if err != nil {
		t.Fatal(err)
	}
	if f.agent, err = kubernetes.NewForConfig(cfg); err != nil {
		t.Fatal(err)
	}
	if f.dyn, err = dynamic.NewForConfig(cfg); err != nil {
		t.Fatal(err)
	}
	if f.meta, err = metadata.NewForConfig(cfg); err != nil {
		t.Fatal(err)
	}
	pp := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": policy.APIVersion, "kind": policy.Kind,
		"metadata": map[string]any{"name": reachPolicy},
		"spec":     map[string]any{"nodeSelector": map[string]any{}, "models": []any{"hf://org/model@main"}},
	}}
	pp, err = f.adyn.Resource(policiesGVR).Create(ctx, pp, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if f.policy, err = policy.FromUnstructured(pp); err != nil {
		t.Fatal(err)
	}
	// n2's agent's status, written as n2's agent writes it.
	if _, err := f.adyn.Resource(policy.NodeGVR).Apply(ctx, policy.NodeObjectName(reachPolicy, "n2"), f.nodeStatus(t, "n2", "Ready"),
		metav1.ApplyOptions{FieldManager: policy.FieldManager("n2"), Force: true}); err != nil {
		t.Fatal(err)
	}
	f.waitEnforced(t)
	return f
}

// applyFile creates every object of a deploy YAML file.
func (f *reachFixture) applyFile(t *testing.T, path string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			return
		} else if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if obj == nil {
			continue
		}
		u := &unstructured.Unstructured{Object: obj}
		gvr, ok := deployKinds[u.GetKind()]
		if !ok {
			t.Fatalf("%s: kind %s unknown to the fixture", path, u.GetKind())
		}
		var r dynamic.ResourceInterface = f.adyn.Resource(gvr)
		if u.GetNamespace() != "" {
			r = f.adyn.Resource(gvr).Namespace(u.GetNamespace())
		}
		if _, err := r.Create(t.Context(), u, metav1.CreateOptions{}); err != nil {
			t.Fatalf("%s: creating %s %s: %v", path, u.GetKind(), u.GetName(), err)
		}
	}
}

func (f *reachFixture) createPod(t *testing.T, namespace, name, node, sa string) *corev1.Pod {
	t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			NodeName:           node,
			ServiceAccountName: sa,
			Containers:         []corev1.Container{{Name: "c", Image: "example.com/c:1"}},
		},
	}
	p, err := f.admin.CoreV1().Pods(namespace).Create(t.Context(), p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// waitEnforced waits until the API server's policy cache refuses n1's agent
// a write to node n2, so that every later refusal is the policy's.
func (f *reachFixture) waitEnforced(t *testing.T) {
	t.Helper()
	annotate := []byte(`{"metadata":{"annotations":{"weightd.io/cache":"x"}}}`)
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := f.agent.CoreV1().Nodes().Patch(t.Context(), "n2", types.MergePatchType, annotate, metav1.PatchOptions{})
		if apierrors.IsForbidden(err) || apierrors.IsInvalid(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("patching node n2 as n1's agent: %v, want refused by the admission policy", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// refused fails the test unless err is the admission policies' refusal.
func refused(t *testing.T, what string, err error) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: accepted, want refused by the admission policy", what)
		return
	}
	if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "ValidatingAdmissionPolicy") {
		t.Errorf("%s: %v, want refused by the admission policy", what, err)
		return
	}
	t.Logf("%s: refused: %v", what, err)
}

// nodeStatus is node's PrefetchPolicyNode of the fixture's policy, as the
// agent applies it.
func (f *reachFixture) nodeStatus(t *testing.T, node, state string) *unstructured.Unstructured {
	t.Helper()
	u, err := policy.NodeStatusObject(f.policy, policy.NodeStatus{
		Name: node, State: policy.NodeState(state), Ready: []string{"hf://org/model@main"}, ReadyCount: 1, Bytes: 1,
		ObservedGeneration: 1, Updated: metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)),
	})
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// TestAgentSetsNodeRestrictionLabel: labels under
// node-restriction.kubernetes.io/ are the ones a kubelet may not set on its
// own Node, so that workloads can trust them for placement; nor may the
// agent. Nor any other label or annotation not weightd's.
func TestAgentSetsNodeRestrictionLabel(t *testing.T) {
	f := newReachFixture(t)
	ctx := t.Context()
	for _, patch := range []string{
		`{"metadata":{"labels":{"node-restriction.kubernetes.io/secure":"true"}}}`,
		`{"metadata":{"labels":{"nvidia.com/gpu.present":null}}}`,
		`{"metadata":{"annotations":{"node.alpha.kubernetes.io/ttl":"0"}}}`,
	} {
		_, err := f.agent.CoreV1().Nodes().Patch(ctx, "n1", types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		refused(t, "n1's agent patching its node with "+patch, err)
	}
	// Server-side apply, as the node publisher writes, with a foreign label.
	_, err := f.agent.CoreV1().Nodes().Patch(ctx, "n1", types.ApplyPatchType,
		[]byte(`{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1","labels":{"models.weightd.io/abc":"ready","node-restriction.kubernetes.io/secure":"true"}}}`),
		metav1.PatchOptions{FieldManager: kube.FieldManager, Force: new(true)})
	refused(t, "n1's agent applying a node-restriction label", err)
}

// TestAgentRemovesTaint: the taints and the rest of the Node's spec are the
// cluster's, not the agent's.
func TestAgentRemovesTaint(t *testing.T) {
	f := newReachFixture(t)
	ctx := t.Context()
	for _, patch := range []string{
		`{"spec":{"taints":null}}`,
		`{"spec":{"unschedulable":true}}`,
	} {
		_, err := f.agent.CoreV1().Nodes().Patch(ctx, "n1", types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		refused(t, "n1's agent patching its node with "+patch, err)
	}
	n, err := f.admin.CoreV1().Nodes().Get(ctx, "n1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(n.Spec.Taints) != 1 {
		t.Errorf("node n1's taints: %v, want the one the cluster set", n.Spec.Taints)
	}
}

// TestAgentEditsPod: on a pod of its node the agent writes weightd's answer
// annotations, nothing else: not the spec, not labels, not other
// annotations, not the status; nor does it create or delete pods.
func TestAgentEditsPod(t *testing.T) {
	f := newReachFixture(t)
	ctx := t.Context()
	for _, patch := range []string{
		`{"metadata":{"labels":{"app":"other"}}}`,
		`{"metadata":{"labels":{"team":"admins"}}}`,
		`{"metadata":{"annotations":{"weightd.io/models":"hf://evil/model@main"}}}`,
		`{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":"now"}}}`,
		`{"metadata":{"finalizers":["example.com/hold"]}}`,
		`{"spec":{"activeDeadlineSeconds":1}}`,
		`{"spec":{"containers":[{"name":"c","image":"evil.example.com/c:1"}]}}`,
	} {
		_, err := f.agent.CoreV1().Pods("default").Patch(ctx, "w1", types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		refused(t, "n1's agent patching pod w1 (on n1) with "+patch, err)
	}
	_, err := f.agent.CoreV1().Pods("default").Patch(ctx, "w1", types.MergePatchType,
		[]byte(`{"status":{"conditions":[{"type":"Ready","status":"False"}]}}`), metav1.PatchOptions{}, "status")
	if err == nil {
		t.Error("n1's agent patched the status of pod w1: accepted, want refused")
	}
	p, err := f.admin.CoreV1().Pods("default").Get(ctx, "w1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p.Labels["app"] != "w1" || len(p.Labels) != 1 || p.Spec.Containers[0].Image != "example.com/c:1" || len(p.Finalizers) != 0 {
		t.Errorf("pod w1 after the attempts: labels %v, image %s, finalizers %v", p.Labels, p.Spec.Containers[0].Image, p.Finalizers)
	}
}

// TestAgentWritesOtherNodesPolicyStatus: each node's progress on a policy
// is a PrefetchPolicyNode of its own, its agent's; one agent can neither
// write nor delete another's, nor make one that claims another node, nor
// write anything of a policy but the counts of its status.
func TestAgentWritesOtherNodesPolicyStatus(t *testing.T) {
	f := newReachFixture(t)
	ctx := t.Context()
	apply := func(u *unstructured.Unstructured, manager string) error {
		_, err := f.dyn.Resource(policy.NodeGVR).Apply(ctx, u.GetName(), u, metav1.ApplyOptions{FieldManager: manager, Force: true})
		return err
	}
	for _, manager := range []string{policy.FieldManager("n1"), policy.FieldManager("n2")} {
		refused(t, "n1's agent applying n2's status as "+manager, apply(f.nodeStatus(t, "n2", "Failed"), manager))
	}
	// Its own object, claiming another node.
	claims := f.nodeStatus(t, "n1", "Ready")
	claims.Object["status"].(map[string]any)["name"] = "n2"
	refused(t, "n1's agent applying its object with status.name n2", apply(claims, policy.FieldManager("n1")))
	claims = f.nodeStatus(t, "n1", "Ready")
	claims.SetLabels(map[string]string{policy.PolicyLabel: reachPolicy, policy.NodeLabel: "n2"})
	refused(t, "n1's agent applying its object labelled as n2's", apply(claims, policy.FieldManager("n1")))
	// Another node's name, claiming this node; its own, owned by another
	// object.
	claims = f.nodeStatus(t, "n1", "Ready")
	claims.SetName(policy.NodeObjectName(reachPolicy, "n3"))
	refused(t, "n1's agent creating n3's object", apply(claims, policy.FieldManager("n1")))
	claims = f.nodeStatus(t, "n1", "Ready")
	claims.SetOwnerReferences([]metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: "n1", UID: "x"}})
	refused(t, "n1's agent applying its object owned by its Node", apply(claims, policy.FieldManager("n1")))

	err := policy.DeleteNodeStatus(ctx, f.dyn, reachPolicy, "n2")
	refused(t, "n1's agent deleting n2's status", err)
	merge := []byte(`{"status":{"state":"Failed"}}`)
	_, err = f.dyn.Resource(policy.NodeGVR).Patch(ctx, policy.NodeObjectName(reachPolicy, "n2"), types.MergePatchType, merge, metav1.PatchOptions{})
	refused(t, "n1's agent merge-patching n2's status", err)

	got, err := f.adyn.Resource(policy.NodeGVR).Get(ctx, policy.NodeObjectName(reachPolicy, "n2"), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n, err := policy.NodeFromUnstructured(got)
	if err != nil {
		t.Fatal(err)
	}
	if n.Status.Name != "n2" || n.Status.State != policy.NodeReady || len(got.GetManagedFields()) != 1 {
		t.Errorf("n2's status after the attempts: %+v, managed by %d, want Ready, by n2 alone", n.Status, len(got.GetManagedFields()))
	}
}

// TestAgentEventForOtherNode: Events from an agent are about its own Node,
// pods and policies, reported from its node; it neither reports as another
// node nor rewrites Events others reported.
func TestAgentEventForOtherNode(t *testing.T) {
	f := newReachFixture(t)
	ctx := t.Context()
	event := func(kind, namespace, name, host string) *corev1.Event {
		return &corev1.Event{
			ObjectMeta:     metav1.ObjectMeta{GenerateName: name + ".", Namespace: cmp.Or(namespace, "default")},
			InvolvedObject: corev1.ObjectReference{Kind: kind, Namespace: namespace, Name: name, UID: types.UID(name), APIVersion: "v1"},
			Reason:         "NodeNotReady", Message: "forged", Type: corev1.EventTypeWarning,
			Source: corev1.EventSource{Component: kube.FieldManager, Host: host},
		}
	}
	for _, c := range []struct {
		what string
		ev   *corev1.Event
	}{
		{"an Event on node n2", event("Node", "", "n2", "n1")},
		{"an Event on its node as reported by n2", event("Node", "", "n1", "n2")},
		{"an Event on a pod as reported by the kubelet of n2", event("Pod", "default", "w2", "n2")},
		{"an Event on a Secret", event("Secret", "default", "s", "n1")},
		{"an Event with no source host", event("Pod", "default", "w1", "")},
	} {
		_, err := f.agent.CoreV1().Events(c.ev.Namespace).Create(ctx, c.ev, metav1.CreateOptions{})
		refused(t, "n1's agent creating "+c.what, err)
	}
	kubelet := event("Node", "", "n2", "n2")
	kubelet.Source.Component = "kubelet"
	kubelet, err := f.admin.CoreV1().Events("default").Create(ctx, kubelet, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.agent.CoreV1().Events("default").Patch(ctx, kubelet.Name, types.MergePatchType,
		[]byte(`{"message":"all is well","type":"Normal"}`), metav1.PatchOptions{})
	refused(t, "n1's agent rewriting the kubelet's Event on node n2", err)
}

// TestAgentOwnWritesAllowed: every write the agent makes passes the
// policies, in the shapes the agent's code makes them.
func TestAgentOwnWritesAllowed(t *testing.T) {
	f := newReachFixture(t)
	ctx := t.Context()
	// The node publisher: server-side apply of the cache and warm labels
	// and the summary annotation, then of fewer labels.
	for _, labels := range []string{`"models.weightd.io/abc":"ready","warm.weightd.io/def":"ready"`, `"models.weightd.io/abc":"ready"`} {
		apply := `{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1","labels":{` + labels + `},"annotations":{"` + nodestate.SummaryAnnotation + `":"{\"v\":1}"}}}`
		if _, err := f.agent.CoreV1().Nodes().Patch(ctx, "n1", types.ApplyPatchType, []byte(apply),
			metav1.PatchOptions{FieldManager: kube.FieldManager, Force: new(true)}); err != nil {
			t.Errorf("applying its node's labels: %v", err)
		}
	}
	// Pod intake and the warm pool: merge patches of weightd's answer
	// annotations, with the pod's UID as a precondition; null removes.
	w1, err := f.admin.CoreV1().Pods("default").Get(ctx, "w1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, ann := range []map[string]any{
		{podrequest.Status: "Ready"},
		{podrequest.LoraEndpoint: "http://10.0.0.1:8000", podrequest.LoraModel: "a", podrequest.LoraError: nil},
		{podrequest.LoraEndpoint: nil, podrequest.LoraModel: nil, podrequest.LoraError: "no warm server"},
		{nodestate.LoadedAdaptersAnnotation: `["a"]`},
		{nodestate.LoadedAdaptersAnnotation: nil},
	} {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"uid": w1.UID, "annotations": ann}})
		if _, err := f.agent.CoreV1().Pods("default").Patch(ctx, "w1", types.MergePatchType, patch,
			metav1.PatchOptions{FieldManager: kube.FieldManager}); err != nil {
			t.Errorf("patching pod w1 with %s: %v", patch, err)
		}
	}
	// The policy controller: its own status, applied twice, then deleted.
	for _, state := range []string{"Fetching", "Ready"} {
		if _, err := f.dyn.Resource(policy.NodeGVR).Apply(ctx, policy.NodeObjectName(reachPolicy, "n1"), f.nodeStatus(t, "n1", state),
			metav1.ApplyOptions{FieldManager: policy.FieldManager("n1"), Force: true}); err != nil {
			t.Errorf("applying its own status (%s): %v", state, err)
		}
	}
	if err := policy.DeleteNodeStatus(ctx, f.dyn, reachPolicy, "n1"); err != nil {
		t.Errorf("deleting its own status: %v", err)
	}
	// The Summarizer: elected with its Lease, it counts n2's status into
	// the policy's.
	sctx, stopSummary := context.WithCancel(ctx)
	summary, err := policy.NewSummarizer("n1", f.agent, f.dyn, f.meta, policy.SummaryConfig{Interval: 100 * time.Millisecond, RetryPeriod: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	summarized := make(chan error, 1)
	go func() { summarized <- summary.Run(sctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		pp, err := f.adyn.Resource(policiesGVR).Get(ctx, reachPolicy, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n, _, _ := unstructured.NestedInt64(pp.Object, "status", "readyNodes"); n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the policy's counts as the agent's Summarizer writes them: status %v", pp.Object["status"])
		}
		time.Sleep(100 * time.Millisecond)
	}
	lease, err := f.admin.CoordinationV1().Leases(reachNamespace).Get(ctx, policy.DefaultSummaryConfig().LeaseName, metav1.GetOptions{})
	if err != nil || lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity != "n1" {
		t.Errorf("the Lease: %+v, %v; want held by n1", lease, err)
	}
	stopSummary()
	if err := <-summarized; err != nil {
		t.Error(err)
	}
	// Events through the agent's recorder (created, then patched as they
	// repeat) on its node, on a pod of its node and on a policy.
	events, err := kube.NewNodeEvents(f.agent, "n1", nil)
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- events.Run(rctx) }()
	events.Event(corev1.EventTypeWarning, kube.ReasonMirrorNotConfigured, "twice")
	events.Event(corev1.EventTypeWarning, kube.ReasonMirrorNotConfigured, "twice")
	waitEvent(t, f.admin, "default", "involvedObject.name=n1,reason="+kube.ReasonMirrorNotConfigured, 2)
	stop()
	<-done
	// The recorder of pod and policy Events, built as the agent builds it.
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	defer broadcaster.Shutdown()
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: f.agent.CoreV1().Events("")})
	recorded := broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: kube.FieldManager, Host: "n1"})
	w1Ref := &corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: "default", Name: "w1", UID: w1.UID}
	recorded.Event(w1Ref, corev1.EventTypeNormal, kube.ReasonPrefetched, "twice")
	recorded.Event(w1Ref, corev1.EventTypeNormal, kube.ReasonPrefetched, "twice")
	waitEvent(t, f.admin, "default", "involvedObject.name=w1,reason="+kube.ReasonPrefetched, 2)
	// The CSI plugin's announcement of a model volume's revision.
	volumes, err := kube.NewPodVolumes(f.agent, "n1", nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	vctx, stopVolumes := context.WithCancel(ctx)
	go func() { done <- volumes.Run(vctx) }()
	volumes.Announce(ctx, csi.Published{Namespace: "default", Pod: "w1", PodUID: string(w1.UID), Volume: "model",
		Ref: "hf://org/model@main", Resolved: "hf://org/model@" + strings.Repeat("a", 40), Files: 2, Bytes: 3 << 20})
	waitEvent(t, f.admin, "default", "involvedObject.name=w1,reason="+kube.ReasonModelVolumeReady, 1)
	w1, err = f.admin.CoreV1().Pods("default").Get(ctx, "w1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := w1.Annotations[kube.VolumeAnnotationPrefix+"model"]; got != "hf://org/model@"+strings.Repeat("a", 40) {
		t.Errorf("the volume's revision annotation is %q", got)
	}
	stopVolumes()
	<-done
	pp, err := f.adyn.Resource(policiesGVR).Get(ctx, reachPolicy, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	recorded.Event(pp, corev1.EventTypeWarning, "FetchFailed", "node n1: hf://org/model@main: gone")
	waitEvent(t, f.admin, "default", "involvedObject.name="+reachPolicy+",reason=FetchFailed", 1)
}

// waitEvent waits for an Event matching selector whose count reaches count.
func waitEvent(t *testing.T, cs kubernetes.Interface, namespace, selector string, count int32) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		evs, err := cs.CoreV1().Events(namespace).List(t.Context(), metav1.ListOptions{FieldSelector: selector})
		if err == nil {
			for _, e := range evs.Items {
				if e.Count >= count {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			t.Errorf("no Event %s with count %d in 30s (%v)", selector, count, err)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestAgentPoliciesTypeCheck: the control plane (kube-controller-manager)
// type-checks each policy's expressions against the kinds it matches; a
// warning there is an expression that fails at admission time, and so a
// write refused.
func TestAgentPoliciesTypeCheck(t *testing.T) {
	f := newReachFixtureIn(t, kubetest.Config{ControlPlane: true})
	for _, name := range []string{"weightd-agent-own-node", "weightd-agent-policy-status", "weightd-agent-policy-node", "weightd-agent-events"} {
		deadline := time.Now().Add(30 * time.Second)
		for {
			vap, err := f.admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(t.Context(), name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if vap.Status.ObservedGeneration == vap.Generation && vap.Status.TypeChecking != nil {
				for _, w := range vap.Status.TypeChecking.ExpressionWarnings {
					t.Errorf("policy %s: %s: %s", name, w.FieldRef, w.Warning)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("policy %s not type-checked in 30s: %+v", name, vap.Status)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}
