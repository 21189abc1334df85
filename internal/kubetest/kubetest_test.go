package kubetest_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/weightd/weightd/internal/kubetest"
)

func TestNodeAndRestart(t *testing.T) {
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	cs := env.Clientset()

	node, err := env.CreateNode(ctx, "gpu-0", map[string]string{"nvidia.com/gpu.present": "true"})
	if err != nil {
		t.Fatal(err)
	}
	if node.Labels["nvidia.com/gpu.present"] != "true" || node.Labels[corev1.LabelHostname] != "gpu-0" {
		t.Errorf("labels = %v", node.Labels)
	}
	if len(node.Status.Conditions) != 1 || node.Status.Conditions[0].Status != corev1.ConditionTrue {
		t.Errorf("conditions = %v", node.Status.Conditions)
	}
	if node.Status.Allocatable.Cpu().Value() != 8 {
		t.Errorf("allocatable = %v", node.Status.Allocatable)
	}

	// A watch from before the restart ends with it; the same client
	// (same Config, so the same CA and credentials) works after it.
	w, err := cs.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	<-w.ResultChan() // the ADDED event of gpu-0

	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().Nodes().Get(ctx, "gpu-0", metav1.GetOptions{}); err == nil {
		t.Fatal("the API server answered while stopped")
	}
	select {
	case _, ok := <-w.ResultChan():
		if ok {
			t.Log("an event after the stop (expected the watch to end)")
		}
	case <-time.After(10 * time.Second):
		t.Error("the watch did not end when the API server stopped")
	}
	if err := env.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	got, err := cs.CoreV1().Nodes().Get(ctx, "gpu-0", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("after the restart: %v", err)
	}
	if got.UID != node.UID {
		t.Errorf("node UID %s, want %s: etcd's data did not survive", got.UID, node.UID)
	}
	if err := env.StartAPIServer(ctx); err == nil {
		t.Error("StartAPIServer while running: no error")
	}
}

// requireKubectl returns kubectl's path; a missing kubectl skips the test,
// or fails it under CI=true.
func requireKubectl(t *testing.T) string {
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

func TestKubeconfig(t *testing.T) {
	kubectl := requireKubectl(t)
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	if _, err := env.CreateNode(ctx, "n1", nil); err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", env.Kubeconfig, "get", "nodes", "-o", "name").CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl: %v\n%s", err, out)
	}
	if strings.TrimSpace(string(out)) != "node/n1" {
		t.Errorf("kubectl get nodes = %q", out)
	}
}

// TestServiceAccountToken checks what the deploy's admission policy relies
// on: a token bound to a pod carries the pod's node name in the user's
// extra, and RBAC applies to the service account.
func TestServiceAccountToken(t *testing.T) {
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	cs := env.Clientset()
	if _, err := env.CreateNode(ctx, "n1", nil); err != nil {
		t.Fatal(err)
	}
	sa, err := cs.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "agent"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "agent-n1"},
		Spec: corev1.PodSpec{
			NodeName:           "n1",
			ServiceAccountName: sa.Name,
			Containers:         []corev1.Container{{Name: "a", Image: "example.com/a"}},
		},
	}
	if pod, err = cs.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg, err := env.ServiceAccountConfig(ctx, "default", sa.Name, pod)
	if err != nil {
		t.Fatal(err)
	}
	sacs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	review, err := sacs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ui := review.Status.UserInfo
	if ui.Username != "system:serviceaccount:default:agent" {
		t.Errorf("user = %q", ui.Username)
	}
	if got := ui.Extra["authentication.kubernetes.io/node-name"]; len(got) != 1 || got[0] != "n1" {
		t.Errorf("extra node-name = %v (extra %v)", got, ui.Extra)
	}
	// The same identity in a kubeconfig file, for a process.
	if kubectl, err := exec.LookPath("kubectl"); err == nil {
		path := filepath.Join(t.TempDir(), "kubeconfig")
		if err := kubetest.WriteKubeconfig(path, cfg); err != nil {
			t.Fatal(err)
		}
		out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", path, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").CombinedOutput()
		if err != nil || string(out) != "system:serviceaccount:default:agent" {
			t.Errorf("kubectl auth whoami: %q, %v", out, err)
		}
	}
	// No role binds it: RBAC refuses.
	if _, err := sacs.CoreV1().Nodes().List(ctx, metav1.ListOptions{}); err == nil {
		t.Error("a service account without roles listed nodes")
	}
}

func TestAssetsDir(t *testing.T) {
	t.Setenv("WEIGHTD_KUBE_ASSETS", "/x/y")
	if d, _ := kubetest.AssetsDir(); d != "/x/y" {
		t.Errorf("AssetsDir = %q", d)
	}
	t.Setenv("WEIGHTD_KUBE_ASSETS", "")
	t.Setenv("HOME", "/home/u")
	if d, _ := kubetest.AssetsDir(); d != filepath.Join("/home/u/.cache/weightd/kube-1.37.2") {
		t.Errorf("AssetsDir = %q", d)
	}
	// KUBEBUILDER_ASSETS is honoured only when it holds both binaries.
	dir := t.TempDir()
	t.Setenv("WEIGHTD_KUBE_ASSETS", filepath.Join(dir, "none"))
	t.Setenv("KUBEBUILDER_ASSETS", dir)
	if _, err := kubetest.FindAssets(); err == nil {
		t.Error("FindAssets found an empty directory")
	}
	for _, n := range []string{"etcd", "kube-apiserver"} {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if d, err := kubetest.FindAssets(); err != nil || d != dir {
		t.Errorf("FindAssets = %q, %v", d, err)
	}
}

// TestControlPlane starts the controller manager and scheduler beside the
// API server: the default service account appears (Start waits for it)
// and a node's identity from UserConfig is the one the API server sees.
func TestControlPlane(t *testing.T) {
	t.Parallel()
	e := kubetest.NewT(t, kubetest.Config{ControlPlane: true})
	cfg, err := e.UserConfig("system:node:n1", "system:nodes")
	require.NoError(t, err)
	c, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	review, err := c.AuthenticationV1().SelfSubjectReviews().Create(t.Context(), &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Equal(t, "system:node:n1", review.Status.UserInfo.Username)
	require.Contains(t, review.Status.UserInfo.Groups, "system:nodes")
}
