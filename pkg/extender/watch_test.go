package extender

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/nodestate"
)

// TestWatcher runs the informer-backed cache against a real API server:
// nodes with summary annotations are scored, an agent's update of a summary
// changes the score, a deleted node is forgotten.
func TestWatcher(t *testing.T) {
	t.Parallel()
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	client, err := kubernetes.NewForConfig(env.Config)
	require.NoError(t, err)

	// As an agent publishes its node's state: labels, then the summary.
	publish := func(name string, opts ...nodeOpt) {
		t.Helper()
		n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		want := mkNode(t, name, opts...)
		for k, v := range want.Labels {
			n.Labels[k] = v
		}
		if n.Annotations == nil {
			n.Annotations = map[string]string{}
		}
		for k, v := range want.Annotations {
			n.Annotations[k] = v
		}
		_, err = client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	for _, name := range []string{"gpu-full", "gpu-half", "gpu-cold"} {
		_, err := env.CreateNode(ctx, name, nil)
		require.NoError(t, err)
	}
	publish("gpu-full", summary(entry(refA, 100*gb, 100*gb), entry(refB, 10*gb, 10*gb)), ready(refA), ready(refB))
	publish("gpu-half", summary(entry(refA, 50*gb, 100*gb)))
	// A node listing an image, as the kubelet reports it.
	n, err := client.CoreV1().Nodes().Get(ctx, "gpu-cold", metav1.GetOptions{})
	require.NoError(t, err)
	n.Status.Images = []corev1.ContainerImage{{Names: []string{"docker.io/library/nginx:1.25"}, SizeBytes: 30 * gb}}
	_, err = client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
	require.NoError(t, err)

	c := NewCache()
	w := NewWatcher(client, c)
	assert.False(t, w.Synced())
	wctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(wctx) }()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, w.WaitSynced(sctx))

	srv, _ := testServer(t, c)
	names := []string{"gpu-full", "gpu-half", "gpu-cold"}
	prioritize := func(pod *corev1.Pod) map[string]int64 {
		var got []struct {
			Host  string
			Score int64
		}
		post(t, srv, VerbPrioritize, namesArgs(pod, names...), &got)
		m := map[string]int64{}
		for _, hp := range got {
			m[hp.Host] = hp.Score
		}
		return m
	}
	pod := mkPod(models(refA + "," + refB))
	assert.Equal(t, map[string]int64{"gpu-full": 10, "gpu-half": 5, "gpu-cold": 0}, prioritize(pod))
	assert.Equal(t, map[string]int64{"gpu-full": 0, "gpu-half": 0, "gpu-cold": 10},
		prioritize(mkPod(map[string]string{"weightd.io/prefetch-images": "true"}, "nginx:1.25")))

	// The agent on gpu-half finishes A and holds half of B: 105 of 110 GB,
	// 9 (only a complete node scores 10).
	publish("gpu-half", summary(entry(refA, 100*gb, 100*gb), entry(refB, 5*gb, 10*gb)), ready(refA))
	require.Eventually(t, func() bool { return prioritize(pod)["gpu-half"] == 9 }, 10*time.Second, 20*time.Millisecond,
		"score of gpu-half after its update: %v", prioritize(pod))
	var res struct {
		NodeNames                  *[]string
		FailedAndUnresolvableNodes map[string]string
	}
	post(t, srv, VerbFilter, namesArgs(mkPod(warm(refA+","+refB)), names...), &res)
	assert.Equal(t, []string{"gpu-full"}, *res.NodeNames)
	assert.Contains(t, res.FailedAndUnresolvableNodes["gpu-half"], "hf://org/lora@main (50%)")

	// A deleted node is forgotten, and with it the size it alone knew.
	require.NoError(t, client.CoreV1().Nodes().Delete(ctx, "gpu-cold", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return c.Len() == 2 }, 10*time.Second, 20*time.Millisecond)
	c.mu.RLock()
	assert.Zero(t, c.total(nodestate.Key(imgNginx)))
	c.mu.RUnlock()

	stop()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("watcher did not stop")
	}
	assert.False(t, w.Synced())
}

func TestStripNode(t *testing.T) {
	t.Parallel()
	n := mkNode(t, "n", ready(refA), summary(entry(refA, 1, 1)), annotate("other", "x"), image(5, "nginx"))
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady}}
	n.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}
	out, err := stripNode(n)
	require.NoError(t, err)
	s := out.(*corev1.Node)
	assert.Equal(t, map[string]string{nodestate.Label(refA): "ready"}, s.Labels)
	assert.Len(t, s.Annotations, 1)
	assert.Empty(t, s.Status.Conditions)
	assert.Empty(t, s.ManagedFields)
	assert.Equal(t, n.Status.Images, s.Status.Images)
	assert.Equal(t, "1", s.ResourceVersion)
	// What the cache computes is the same either way.
	a, _ := newNodeInfo(fieldsOf(n))
	b, _ := newNodeInfo(fieldsOf(s))
	assert.Equal(t, a.held, b.held)
}

// TestWatcherAPIServerRestart stops and restarts the API server under a
// running watcher: the extender keeps answering from its cache meanwhile,
// and changes made after the restart reach it.
func TestWatcherAPIServerRestart(t *testing.T) {
	t.Parallel()
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	client, err := kubernetes.NewForConfig(env.Config)
	require.NoError(t, err)
	n, err := env.CreateNode(ctx, "gpu-0", map[string]string{nodestate.Label(refA): nodestate.LabelReady})
	require.NoError(t, err)

	c := NewCache()
	w := NewWatcher(client, c)
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	go w.Run(wctx)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, w.WaitSynced(sctx))
	srv, _ := testServer(t, c)
	score := func() int64 {
		var got []struct {
			Host  string
			Score int64
		}
		post(t, srv, VerbPrioritize, namesArgs(mkPod(models(refA+","+refB)), "gpu-0"), &got)
		require.Len(t, got, 1)
		return got[0].Score
	}
	assert.Equal(t, int64(5), score(), "A of A and B, sizes unknown")

	require.NoError(t, env.StopAPIServer())
	assert.Equal(t, int64(5), score(), "answers from the cache while the API server is down")
	require.NoError(t, env.StartAPIServer(ctx))

	n, err = client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
	require.NoError(t, err)
	n.Labels[nodestate.Label(refB)] = nodestate.LabelReady
	_, err = client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return score() == 10 }, 60*time.Second, 50*time.Millisecond, "the watcher reconnected")
}
