package kube

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

// TestWarmPodsFakeAPI runs WarmPods against client-go's fake clientset (no
// API server needed): a running warm server is given to the pool, a pod's
// adapter request is answered on it, the server pod lists the adapter, and
// the request is released when its pod goes.
func TestWarmPodsFakeAPI(t *testing.T) {
	t.Parallel()
	const base = "hf://org/base@main"
	srv := warmServerPod("srv", "n1", map[string]string{
		podrequest.WarmBase: base, podrequest.WarmRuntime: "sglang", podrequest.WarmPort: "30000", podrequest.WarmSlots: "2",
	})
	srv.UID = "uid-srv"
	srv.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.1.2.3"}
	client := fake.NewClientset(srv)
	pool := newFakePool()
	w, err := NewWarmPods(client, "n1", pool, WithWarmInterval(20*time.Millisecond), WithWarmRetry(10*time.Millisecond, 50*time.Millisecond),
		WithWarmServerNamespaces("default"))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { require.NoError(t, w.Run(ctx)) })
	defer wg.Wait()
	defer cancel()

	pods := client.CoreV1().Pods("default")
	annotation := func(name, key string) string {
		p, err := pods.Get(t.Context(), name, metav1.GetOptions{})
		require.NoError(t, err)
		return p.Annotations[key]
	}
	eventually(t, 10*time.Second, func() string {
		if specs, _ := pool.lastSet(); len(specs) != 1 || specs[0].Endpoint != "http://10.1.2.3:30000" || specs[0].Runtime != "sglang" {
			return fmt.Sprintf("servers %+v", specs)
		}
		return ""
	})
	c := newPod("c", "n1", map[string]string{podrequest.LoraBase: base, podrequest.LoraAdapter: "hf://org/a", podrequest.LoraName: "a"})
	c.UID = "uid-c"
	_, err = pods.Create(t.Context(), c, metav1.CreateOptions{})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() string {
		if e, m := annotation("c", podrequest.LoraEndpoint), annotation("c", podrequest.LoraModel); e != "http://10.1.2.3:30000" || m != "a" {
			return fmt.Sprintf("answer %q %q", e, m)
		}
		if got := annotation("srv", nodestate.LoadedAdaptersAnnotation); got != `["a"]` {
			return fmt.Sprintf("loaded adapters %q", got)
		}
		return ""
	})
	require.Equal(t, 1, w.Tracked())
	require.NoError(t, pods.Delete(t.Context(), "c", metav1.DeleteOptions{}))
	eventually(t, 10*time.Second, func() string {
		if !pool.wasReleased(c.UID) || w.Tracked() != 0 {
			return fmt.Sprintf("pod c released %t, tracked %d", pool.wasReleased(c.UID), w.Tracked())
		}
		return ""
	})
}
