package main

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

// TestAgentKubernetes runs the agent as `weightd agent --kubeconfig` would
// against a real API server: a pod bound to its node gets its model, its
// status annotation says ready, and the node is labelled.
func TestAgentKubernetes(t *testing.T) {
	env := kubetest.NewT(t, kubetest.Config{})
	const node = "gpu-node-1"
	if _, err := env.CreateNode(t.Context(), node, nil); err != nil {
		t.Fatal(err)
	}
	ref, _ := startOrigin(t, 2, 4<<20)
	api := startAgentWith(t, func(c *agentConfig) {
		c.Kubeconfig, c.NodeName, c.NodeUpdateInterval = env.Kubeconfig, node, 500*time.Millisecond
	})
	pods := env.Clientset().CoreV1().Pods("default")
	podReady := func(name, ref string) {
		t.Helper()
		_, err := pods.Create(t.Context(), &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{podrequest.Models: ref}},
			Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(60 * time.Second)
		for {
			p, err := pods.Get(t.Context(), name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			n, err := env.Clientset().CoreV1().Nodes().Get(t.Context(), node, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			status, label := p.Annotations[podrequest.Status], n.Labels[nodestate.Label(ref)]
			if status == "ready" && label == nodestate.LabelReady {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("pod %s status %q, node label %q", name, status, label)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	podReady("llm", ref)

	// Without the API server the agent goes on serving: a fetch through its
	// API works; then the informers reconnect and a new pod is answered.
	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	ref2, _ := startOrigin(t, 3, 4<<20)
	if code, _, errOut := runCLI(t, "fetch", "--wait", "--api", api, ref2); code != 0 {
		t.Fatalf("fetch while the API server is down: exit %d: %s", code, errOut)
	}
	if err := env.StartAPIServer(t.Context()); err != nil {
		t.Fatal(err)
	}
	ref3, _ := startOrigin(t, 5, 4<<20)
	podReady("llm-2", ref3)
}

func TestKeyCommand(t *testing.T) {
	code, out, errOut := runCLI(t, "key", "hf://meta-llama/Llama-3.1-8B-Instruct@main")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	label := nodestate.Label("hf://meta-llama/Llama-3.1-8B-Instruct@main")
	for _, want := range []string{"key: " + nodestate.Key("hf://meta-llama/Llama-3.1-8B-Instruct@main"), "label: " + label + "=ready", "- key: " + label} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	var parsed struct {
		Key      string          `json:"key"`
		Label    string          `json:"label"`
		Affinity corev1.Affinity `json:"affinity"`
	}
	if err := yaml.UnmarshalStrict([]byte(out), &parsed); err != nil {
		t.Fatalf("output is not YAML of a key, a label and an affinity: %v", err)
	}
	if terms := parsed.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution; len(terms) != 1 ||
		terms[0].Preference.MatchExpressions[0].Key != label || terms[0].Preference.MatchExpressions[0].Values[0] != "ready" {
		t.Errorf("affinity %+v", parsed.Affinity)
	}
	code, out, _ = runCLI(t, "key", "--image", "nginx")
	if code != 0 || !strings.Contains(out, nodestate.Key("oci://docker.io/library/nginx:latest")) {
		t.Errorf("exit %d:\n%s", code, out)
	}
	if code, _, _ := runCLI(t, "key", "ftp://nope"); code == 0 {
		t.Error("a bad reference is an error")
	}
}
