package agent

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/prefetch"
)

// TestAgentKubernetes runs the agent as `weightd agent --kubeconfig` would
// against a real API server: a pod bound to its node gets its model, its
// status annotation says ready, and the node is labelled.
func TestAgentKubernetes(t *testing.T) {
	env := kubetest.NewT(t, kubetest.Config{})
	const node = "gpu-node-1"
	if _, err := env.CreateNode(t.Context(), node, map[string]string{corev1.LabelTopologyZone: "zone-a"}); err != nil {
		t.Fatal(err)
	}
	ref, _ := startOrigin(t, 2, 4<<20)
	agent, api := startAgentAndAddr(t, func(c *Config) {
		c.Kubeconfig, c.NodeName, c.NodeUpdateInterval = env.Kubeconfig, node, 500*time.Millisecond
	})
	if agent.cfg.Zone != "zone-a" {
		t.Fatalf("the swarm's zone is %q, not the Node's label zone-a", agent.cfg.Zone)
	}
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
	if st := fetchWait(t, api, ref2); st.State != prefetch.StateReady {
		t.Fatalf("fetch while the API server is down: %+v", st)
	}
	if err := env.StartAPIServer(t.Context()); err != nil {
		t.Fatal(err)
	}
	ref3, _ := startOrigin(t, 5, 4<<20)
	podReady("llm-2", ref3)
}
