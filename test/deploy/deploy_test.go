package deploy_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/peertls"
)

const (
	namespace = "weightd-system"
	kustomize = "../../deploy/daemonset"
)

// kubectl returns kubectl's path; a missing kubectl skips the test, or
// fails it under CI=true.
func kubectl(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("kubectl")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but no kubectl: %v", err)
		}
		t.Skipf("skipping: no kubectl: %v", err)
	}
	return p
}

func run(t *testing.T, ctx context.Context, name string, args ...string) string {
	t.Helper()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestApply follows the README's "Deploy on a cluster" on a real API server: the namespace and
// the gossip key first, then a server-side dry run and the apply itself;
// then it checks every object, and that the admission policy confines an
// agent to its own node.
func TestApply(t *testing.T) {
	kc := kubectl(t)
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	cs := env.Clientset()
	for _, n := range []string{"n1", "n2"} {
		if _, err := env.CreateNode(ctx, n, map[string]string{"nvidia.com/gpu.present": "true"}); err != nil {
			t.Fatal(err)
		}
	}

	k := func(args ...string) string {
		return run(t, ctx, kc, append([]string{"--kubeconfig", env.Kubeconfig}, args...)...)
	}
	k("apply", "-f", filepath.Join(kustomize, "namespace.yaml"))
	k("-n", namespace, "create", "secret", "generic", "weightd-gossip", "--from-literal=keys=MDEyMzQ1Njc4OWFiY2RlZg==")
	peerCA, err := peertls.WriteCA(t.TempDir(), "deploy test CA")
	if err != nil {
		t.Fatal(err)
	}
	k("-n", namespace, "create", "secret", "generic", "weightd-peer-ca", "--from-file=ca.crt="+peerCA.CA, "--from-file=ca.key="+peerCA.Key)
	out := k("apply", "--dry-run=server", "-k", kustomize)
	t.Logf("dry run:\n%s", out)
	if strings.Contains(out, "Warning") {
		t.Errorf("the dry run warned: %s", out)
	}
	if _, err := cs.AppsV1().DaemonSets(namespace).Get(ctx, "weightd", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("after the dry run, the DaemonSet: %v (want not found)", err)
	}
	out = k("apply", "-k", kustomize)
	t.Logf("apply:\n%s", out)

	ds, err := cs.AppsV1().DaemonSets(namespace).Get(ctx, "weightd", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	checkDaemonSet(t, ds.Spec.Template.Spec)
	if _, err := cs.CoreV1().ServiceAccounts(namespace).Get(ctx, "weightd", metav1.GetOptions{}); err != nil {
		t.Error(err)
	}
	svc, err := cs.CoreV1().Services(namespace).Get(ctx, "weightd-gossip", metav1.GetOptions{})
	if err != nil {
		t.Error(err)
	} else if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("gossip Service clusterIP %q, want headless", svc.Spec.ClusterIP)
	}
	cms, err := cs.CoreV1().ConfigMaps(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var config string
	for _, cm := range cms.Items {
		if strings.HasPrefix(cm.Name, "weightd-config-") {
			config = cm.Data["config.yaml"]
		}
	}
	if !strings.Contains(config, "agent:") {
		t.Errorf("no weightd-config-* ConfigMap with config.yaml (%d ConfigMaps)", len(cms.Items))
	}
	if _, err := cs.RbacV1().ClusterRoles().Get(ctx, "weightd-agent", metav1.GetOptions{}); err != nil {
		t.Error(err)
	}
	if _, err := cs.RbacV1().ClusterRoleBindings().Get(ctx, "weightd-agent", metav1.GetOptions{}); err != nil {
		t.Error(err)
	}
	vap, err := cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(ctx, "weightd-agent-own-node", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cs.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Get(ctx, "weightd-agent-own-node", metav1.GetOptions{}); err != nil {
		t.Error(err)
	}
	waitCRD(t, ctx, env, "prefetchpolicies.weightd.io")

	// What the cluster holds is what the files say: kubectl diff finds
	// nothing (exit status 0; 1 means differences).
	if out, err := exec.CommandContext(ctx, kc, "--kubeconfig", env.Kubeconfig, "diff", "-k", kustomize).CombinedOutput(); err != nil {
		t.Errorf("kubectl diff after the apply: %v\n%s", err, out)
	}

	// deploy/csi over what is applied: the API server takes the CSIDriver
	// and the agent's Bidirectional mount, which it refuses unless the
	// container is privileged.
	if out := k("apply", "--dry-run=server", "-k", "../../deploy/csi"); strings.Contains(out, "Warning") || !strings.Contains(out, "csidriver.storage.k8s.io/models.weightd.io created (server dry run)") {
		t.Errorf("the dry run of deploy/csi:\n%s", out)
	}

	t.Run("OwnNodeOnly", func(t *testing.T) { testOwnNodeOnly(t, env) })
	t.Run("Agent", func(t *testing.T) { testAgent(t, env, ds.Spec.Template.Spec.Containers[0]) })
	// The API server type-checks the expressions against Node and Pod in
	// the background: log what it says (a warning does not stop the policy).
	if v, err := cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(ctx, vap.Name, metav1.GetOptions{}); err == nil {
		vap = v
	}
	if w := vap.Status.TypeChecking; w != nil {
		for _, e := range w.ExpressionWarnings {
			t.Logf("policy type checking: %s: %s", e.FieldRef, e.Warning)
		}
	}
}

func checkDaemonSet(t *testing.T, spec corev1.PodSpec) {
	t.Helper()
	if spec.ServiceAccountName != "weightd" || !spec.HostNetwork || spec.PriorityClassName != "system-node-critical" {
		t.Errorf("pod spec: serviceAccount %q hostNetwork %v priorityClass %q", spec.ServiceAccountName, spec.HostNetwork, spec.PriorityClassName)
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers", len(spec.Containers))
	}
	c := spec.Containers[0]
	args := strings.Join(c.Args, " ")
	for _, want := range []string{"agent", "--config=", "--gossip-key-file=", "--join-dns=weightd-gossip.weightd-system.svc.cluster.local"} {
		if !strings.Contains(args, want) {
			t.Errorf("args %q lack %q", args, want)
		}
	}
	var nodeName bool
	for _, e := range c.Env {
		if e.Name == "WEIGHTD_NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName" {
			nodeName = true
		}
	}
	if !nodeName {
		t.Error("no WEIGHTD_NODE_NAME from spec.nodeName")
	}
	if c.ReadinessProbe == nil || c.LivenessProbe == nil {
		t.Error("no readiness or liveness probe")
	}
	if c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %v", c.Resources)
	}
	sc := c.SecurityContext
	if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Privileged == nil || *sc.Privileged {
		t.Errorf("security context %+v: want no privilege and no escalation", sc)
	}
	mounts := map[string]bool{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = true
	}
	// containerd's root holds the cache (TestKustomizeLinkLayout).
	for _, p := range []string{"/var/lib/containerd", "/run/weightd", "/run/containerd/containerd.sock", "/etc/containerd/certs.d"} {
		if !mounts[p] {
			t.Errorf("no mount at %s", p)
		}
	}
}

func waitCRD(t *testing.T, ctx context.Context, env *kubetest.Env, name string) {
	t.Helper()
	dyn, err := dynamic.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	gvr := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	deadline := time.Now().Add(30 * time.Second)
	for {
		u, err := dyn.Resource(gvr).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		for _, c := range conds {
			if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("CRD %s not established: %v", name, conds)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// testOwnNodeOnly acts as the agent of node n1, with a token bound to its
// pod as the kubelet would mount it.
func testOwnNodeOnly(t *testing.T, env *kubetest.Env) {
	ctx := t.Context()
	cs := env.Clientset()
	agentPod := func(name, node string) *corev1.Pod {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
			Spec: corev1.PodSpec{
				NodeName:           node,
				ServiceAccountName: "weightd",
				Containers:         []corev1.Container{{Name: "agent", Image: "ghcr.io/weightd/weightd:latest"}},
			},
		}
		p, err := cs.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	cfg, err := env.ServiceAccountConfig(ctx, namespace, "weightd", agentPod("weightd-n1", "n1"))
	if err != nil {
		t.Fatal(err)
	}
	agent, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct{ name, node string }{{"w1", "n1"}, {"w2", "n2"}} {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name},
			Spec:       corev1.PodSpec{NodeName: p.node, Containers: []corev1.Container{{Name: "c", Image: "example.com/c"}}},
		}
		if _, err := cs.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// Annotations the agent writes (the policy refuses any other key; the
	// adversary suite tests that).
	patchNode := func(c *kubernetes.Clientset, name string) error {
		_, err := c.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"weightd.io/cache":"x"}}}`), metav1.PatchOptions{})
		return err
	}
	patchPod := func(c *kubernetes.Clientset, name string) error {
		_, err := c.CoreV1().Pods("default").Patch(ctx, name, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"weightd.io/status":"x"}}}`), metav1.PatchOptions{})
		if err != nil {
			return err
		}
		// Removed again: testAgent waits for the agent's own status.
		_, err = c.CoreV1().Pods("default").Patch(ctx, name, types.MergePatchType,
			[]byte(`{"metadata":{"annotations":{"weightd.io/status":null}}}`), metav1.PatchOptions{})
		return err
	}

	// The policy is enforced once the API server's policy cache has it:
	// wait for the first refusal.
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := patchNode(agent, "n2")
		if apierrors.IsForbidden(err) || apierrors.IsInvalid(err) {
			if !strings.Contains(err.Error(), "may change only its own node") {
				t.Errorf("patching node n2 as n1's agent: %v, want the policy's message", err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("patching node n2 as n1's agent: %v, want refused", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := patchNode(agent, "n1"); err != nil {
		t.Errorf("patching its own node: %v", err)
	}
	if err := patchPod(agent, "w1"); err != nil {
		t.Errorf("patching a pod on its own node: %v", err)
	}
	if err := patchPod(agent, "w2"); err == nil || !strings.Contains(err.Error(), "may change only its own node") {
		t.Errorf("patching a pod on another node: %v, want refused by the policy", err)
	}
	// Server-side apply, as the node publisher writes labels.
	if _, err := agent.CoreV1().Nodes().Patch(ctx, "n1", types.ApplyPatchType,
		[]byte(`{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1","labels":{"models.weightd.io/abc":"ready"}}}`),
		metav1.PatchOptions{FieldManager: "weightd"}); err != nil {
		t.Errorf("applying its own node's labels: %v", err)
	}
	// What RBAC allows and refuses.
	if _, err := agent.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=n1"}); err != nil {
		t.Errorf("listing its pods: %v", err)
	}
	if _, err := agent.CoreV1().Nodes().Get(ctx, "n2", metav1.GetOptions{}); err != nil {
		t.Errorf("reading another node: %v", err)
	}
	if _, err := agent.CoreV1().Secrets(namespace).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("listing secrets: %v, want forbidden", err)
	}
	if err := agent.CoreV1().Pods("default").Delete(ctx, "w1", metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("deleting a pod: %v, want forbidden", err)
	}
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: "w1.", Namespace: "default"},
		InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "default", Name: "w1", APIVersion: "v1"},
		Reason:         "Prefetched", Message: "test", Type: corev1.EventTypeNormal,
		Source: corev1.EventSource{Component: "weightd", Host: "n1"},
	}
	if _, err := agent.CoreV1().Events("default").Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		t.Errorf("creating an event: %v", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	policies := schema.GroupVersionResource{Group: "weightd.io", Version: "v1alpha1", Resource: "prefetchpolicies"}
	if _, err := dyn.Resource(policies).List(ctx, metav1.ListOptions{}); err != nil {
		t.Errorf("listing PrefetchPolicies: %v", err)
	}

	// A token of the service account that is not bound to a pod carries no
	// node name: it may change no node.
	unbound, err := env.ServiceAccountConfig(ctx, namespace, "weightd", nil)
	if err != nil {
		t.Fatal(err)
	}
	uc, err := kubernetes.NewForConfig(unbound)
	if err != nil {
		t.Fatal(err)
	}
	if err := patchNode(uc, "n1"); err == nil {
		t.Error("a token bound to no pod patched a node")
	}
}

// testAgent runs the agent as a process with the DaemonSet's arguments and
// config.yaml, as the service account of the pod weightd-n1 (bound to node
// n1): the configuration parses, `weightd status` (the probes' command)
// answers, and the agent's Kubernetes side runs under the deploy's RBAC and
// admission policy without being refused anything. Host paths, containerd
// and the ports become local ones.
func testAgent(t *testing.T, env *kubetest.Env, c corev1.Container) {
	ctx := t.Context()
	dir := t.TempDir()
	bin := filepath.Join(dir, "weightd")
	run(t, ctx, "go", "build", "-o", bin, "../../cmd/weightd")

	pod, err := env.Clientset().CoreV1().Pods(namespace).Get(ctx, "weightd-n1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := env.ServiceAccountConfig(ctx, namespace, "weightd", pod)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := kubetest.WriteKubeconfig(kubeconfig, cfg); err != nil {
		t.Fatal(err)
	}
	keys := filepath.Join(dir, "keys")
	if err := os.WriteFile(keys, []byte("MDEyMzQ1Njc4OWFiY2RlZg==\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ca, err := peertls.WriteCA(dir, "deploy test CA")
	if err != nil {
		t.Fatal(err)
	}
	var args []string
	for _, a := range c.Args {
		switch {
		case strings.HasPrefix(a, "--peer-ca-file="):
			a = "--peer-ca-file=" + ca.CA
		case strings.HasPrefix(a, "--peer-ca-key-file="):
			a = "--peer-ca-key-file=" + ca.Key
		case strings.HasPrefix(a, "--config="):
			a = "--config=" + filepath.Join(kustomize, "config.yaml")
		case strings.HasPrefix(a, "--gossip-key-file="):
			a = "--gossip-key-file=" + keys
		case strings.HasPrefix(a, "--join-dns="):
			// With gossip on a free port the name needs a port.
			a = "--join-dns=localhost:1"
		}
		args = append(args, a)
	}
	api := "unix://" + filepath.Join(dir, "weightd.sock")
	args = append(args,
		"--root="+filepath.Join(dir, "cache"),
		"--containerd-address=",
		"--hosts-dir="+filepath.Join(dir, "certs.d"),
		"--metrics-addr=127.0.0.1:0",
		"--gossip-addr=127.0.0.1:0",
		"--chunk-addr=127.0.0.1:0",
		"--mirror-addr=127.0.0.1:0",
	)
	var log strings.Builder
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "WEIGHTD_NODE_NAME=n1", "WEIGHTD_API="+api, "WEIGHTD_KUBECONFIG="+kubeconfig)
	cmd.Stdout = &syncWriter{w: &log}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("agent log:\n%s", cmd.Stdout.(*syncWriter).String())
		}
	}()

	// The probes' command, until it answers.
	deadline := time.Now().Add(60 * time.Second)
	for {
		probe := exec.CommandContext(ctx, bin, "status")
		probe.Env = append(os.Environ(), "WEIGHTD_API="+api)
		if err := probe.Run(); err == nil {
			break
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("the agent exited: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("weightd status did not succeed in 60s")
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Let its informers list and watch, and its first writes go out.
	time.Sleep(3 * time.Second)
	out := cmd.Stdout.(*syncWriter).String()
	for _, line := range strings.Split(out, "\n") {
		l := strings.ToLower(line)
		if strings.Contains(l, "forbidden") || strings.Contains(l, "cannot list") || strings.Contains(l, "cannot watch") {
			t.Errorf("the agent was refused: %s", line)
		}
	}
	if !strings.Contains(out, "weightd agent starting") {
		t.Errorf("no start line in the agent's log")
	}
	if !strings.Contains(out, "Kubernetes features on") {
		t.Errorf("the agent did not use its kubeconfig")
	}

	// It answers on a pod of its node: an Event for a malformed
	// annotation (events: create), the status annotation for a model that
	// cannot be fetched (pods: patch, allowed by the admission policy).
	cs := env.Clientset()
	patch := []byte(`{"metadata":{"annotations":{"weightd.io/models":"hf://"}}}`)
	if _, err := cs.CoreV1().Pods("default").Patch(ctx, "w1", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "an InvalidAnnotation Event on pod w1", func() bool {
		evs, err := cs.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=w1,reason=InvalidAnnotation"})
		return err == nil && len(evs.Items) > 0
	})
	patch = []byte(`{"metadata":{"annotations":{"weightd.io/models":"https://127.0.0.1:1/model.safetensors"}}}`)
	if _, err := cs.CoreV1().Pods("default").Patch(ctx, "w1", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "the weightd.io/status annotation on pod w1", func() bool {
		p, err := cs.CoreV1().Pods("default").Get(ctx, "w1", metav1.GetOptions{})
		return err == nil && p.Annotations["weightd.io/status"] != ""
	})
	p, _ := cs.CoreV1().Pods("default").Get(ctx, "w1", metav1.GetOptions{})
	t.Logf("pod w1: weightd.io/status=%q", p.Annotations["weightd.io/status"])
	out = cmd.Stdout.(*syncWriter).String()
	for _, line := range strings.Split(out, "\n") {
		l := strings.ToLower(line)
		if strings.Contains(l, "forbidden") || strings.Contains(l, "denied") {
			t.Errorf("the agent was refused: %s", line)
		}
	}
}

// syncWriter is a strings.Builder that the agent's stdout and stderr
// copiers and the test may use at once.
type syncWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

func (s *syncWriter) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.String()
}

func waitFor(t *testing.T, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after %s", what, d)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
