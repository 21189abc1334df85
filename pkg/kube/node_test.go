package kube

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/weightd/weightd/internal/genmodel"
	wcache "github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

// TestPublisherFakeAPI runs the node publisher against client-go's fake
// clientset (no API server needed): the node gets its label and summary,
// others' labels stay, a summary from before is restored, and an evicted
// model loses its label.
func TestPublisherFakeAPI(t *testing.T) {
	t.Parallel()
	r, _ := testOrigin(t, "test/model", 2, modelSize)
	old := "hf://org/gone@main"
	before, err := nodestate.Summary{Entries: []nodestate.Entry{
		{Key: nodestate.Key(old), Ref: old, State: nodestate.StateFailed},
	}}.Encode()
	require.NoError(t, err)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name:        "n1",
		Labels:      map[string]string{"team": "a"},
		Annotations: map[string]string{nodestate.SummaryAnnotation: before},
	}})
	store, err := wcache.Open(t.TempDir())
	require.NoError(t, err)
	defer store.Close()
	blobs := &hidingBlobs{store: store}
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	pub, err := NewNodePublisher(client, "n1", queue, blobs, WithNodeInterval(50*time.Millisecond, 200*time.Millisecond))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { _ = queue.Run(ctx) })
	wg.Go(func() { _ = pub.Run(ctx) })
	defer wg.Wait()
	defer cancel()

	_, err = queue.Submit(r, prefetch.PriorityNormal)
	require.NoError(t, err)
	get := func() *corev1.Node {
		n, err := client.CoreV1().Nodes().Get(t.Context(), "n1", metav1.GetOptions{})
		require.NoError(t, err)
		return n
	}
	eventually(t, 20*time.Second, func() string { return nodeShows(t, get(), r, true) })
	n := get()
	assert.Equal(t, "a", n.Labels["team"])
	sum, err := nodestate.Decode(n.Annotations[nodestate.SummaryAnnotation])
	require.NoError(t, err)
	_, ok := sum.Find(nodestate.Key(old))
	assert.False(t, ok, "failed entries are not restored")

	// Quiet: nothing changes, nothing is written.
	writes := pub.Writes()
	time.Sleep(300 * time.Millisecond)
	assert.Equal(t, writes, pub.Writes(), "no write when nothing changed")

	blobs.hidden.Store(true)
	eventually(t, 10*time.Second, func() string { return nodeShows(t, get(), r, false) })
	assert.Equal(t, "a", get().Labels["team"])
}

func TestSameShape(t *testing.T) {
	t.Parallel()
	s := nodestate.Summary{Entries: []nodestate.Entry{{Key: "a-1", Ref: "hf://a@b", State: nodestate.StateFetching, Bytes: 1, Total: 10}}}
	enc, err := s.Encode()
	require.NoError(t, err)
	s.Entries[0].Bytes = 5
	assert.True(t, sameShape(enc, s), "bytes only")
	s.Entries[0].State = nodestate.StateReady
	assert.False(t, sameShape(enc, s))
	assert.False(t, sameShape("", s))
	s.Entries = append(s.Entries, nodestate.Entry{Key: "b-2", State: nodestate.StateReady})
	assert.False(t, sameShape(enc, s), fmt.Sprint(len(s.Entries)))
}

// TestIntakeFakeAPI runs the pod intake against client-go's fake clientset
// (no API server needed; it ignores field selectors, so the intake's own
// check of the node name is exercised too).
func TestIntakeFakeAPI(t *testing.T) {
	t.Parallel()
	r, _ := testOrigin(t, "test/model", 2, modelSize)
	client := fake.NewClientset(
		newPod("p1", "n1", map[string]string{"weightd.io/models": r}),
		newPod("other-node", "n2", map[string]string{"weightd.io/models": r}),
		newPod("bad", "n1", map[string]string{"weightd.io/models": "ftp://x/y"}),
		newPod("missing", "n1", map[string]string{"weightd.io/models": strings.TrimSuffix(r, "model.json") + "nope.json"}),
	)
	store, err := wcache.Open(t.TempDir())
	require.NoError(t, err)
	defer store.Close()
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	in, err := NewPodIntake(client, "n1", queue, WithStatusInterval(50*time.Millisecond, 100*time.Millisecond), WithFirstStatusDelay(0))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { _ = queue.Run(ctx) })
	wg.Go(func() { _ = in.Run(ctx) })
	defer wg.Wait()
	defer cancel()

	status := func(name string) string {
		p, err := client.CoreV1().Pods("default").Get(t.Context(), name, metav1.GetOptions{})
		require.NoError(t, err)
		return p.Annotations["weightd.io/status"]
	}
	eventually(t, 20*time.Second, func() string {
		if s := status("p1"); s != "ready" {
			return "p1: " + s
		}
		return ""
	})
	eventually(t, 10*time.Second, func() string {
		list, err := client.CoreV1().Events("").List(t.Context(), metav1.ListOptions{})
		require.NoError(t, err)
		reasons := map[string]string{}
		for _, e := range list.Items {
			reasons[e.InvolvedObject.Name+" "+e.Reason] = e.Type
		}
		if reasons["bad InvalidAnnotation"] != "Warning" || reasons["p1 Prefetched"] != "Normal" || reasons["missing PrefetchFailed"] != "Warning" {
			return fmt.Sprintf("events %v", reasons)
		}
		return ""
	})
	assert.Empty(t, status("other-node"))
	assert.Empty(t, status("bad"))
	assert.True(t, strings.HasPrefix(status("missing"), "failed: "+strings.TrimSuffix(r, "model.json")+"nope.json: "), status("missing"))
	assert.Equal(t, 3, in.Tracked(), "p1, missing, and bad (so it is reported once)")

	// A finished pod is no longer followed.
	p1, err := client.CoreV1().Pods("default").Get(t.Context(), "p1", metav1.GetOptions{})
	require.NoError(t, err)
	p1.Status.Phase = corev1.PodSucceeded
	_, err = client.CoreV1().Pods("default").UpdateStatus(t.Context(), p1, metav1.UpdateOptions{})
	require.NoError(t, err)
	eventually(t, 10*time.Second, func() string {
		if n := in.Tracked(); n != 2 {
			return fmt.Sprintf("%d pods tracked", n)
		}
		return ""
	})
}

// TestIntakeSettledPod: a pod answered "ready" before the agent restarted is
// not set back to "fetching" while its job runs again.
func TestIntakeSettledPod(t *testing.T) {
	t.Parallel()
	r, _ := testOrigin(t, "test/model", 2, modelSize, genmodel.WithBandwidth(8<<20)) // about a second
	client := fake.NewClientset(newPod("p1", "n1", map[string]string{"weightd.io/models": r, "weightd.io/status": "ready"}))
	store, err := wcache.Open(t.TempDir())
	require.NoError(t, err)
	defer store.Close()
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	in, err := NewPodIntake(client, "n1", queue, WithStatusInterval(50*time.Millisecond, 100*time.Millisecond), WithFirstStatusDelay(0))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { _ = queue.Run(ctx) })
	wg.Go(func() { _ = in.Run(ctx) })
	defer wg.Wait()
	defer cancel()

	eventually(t, 20*time.Second, func() string {
		jobs := queue.Jobs()
		if len(jobs) != 1 || jobs[0].State != prefetch.StateReady {
			return fmt.Sprintf("jobs %d", len(jobs))
		}
		return ""
	})
	time.Sleep(300 * time.Millisecond)
	for _, a := range client.Actions() {
		assert.NotEqual(t, "patch", a.GetVerb(), "%s %s", a.GetVerb(), a.GetResource().Resource)
		assert.NotEqual(t, "events", a.GetResource().Resource, "no Event for an answered pod")
	}
}

// TestIntakeFinalStatusNotHeldBack: after a progress patch, the final
// status is written within the status interval, not held back by the
// longer progress interval.
func TestIntakeFinalStatusNotHeldBack(t *testing.T) {
	t.Parallel()
	r, _ := testOrigin(t, "test/model", 2, modelSize, genmodel.WithBandwidth(8<<20)) // about a second
	client := fake.NewClientset(newPod("p1", "n1", map[string]string{"weightd.io/models": r}))
	store, err := wcache.Open(t.TempDir())
	require.NoError(t, err)
	defer store.Close()
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	in, err := NewPodIntake(client, "n1", queue, WithStatusInterval(100*time.Millisecond, time.Hour), WithFirstStatusDelay(0))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { _ = queue.Run(ctx) })
	wg.Go(func() { _ = in.Run(ctx) })
	defer wg.Wait()
	defer cancel()

	var sawFetching bool
	eventually(t, 20*time.Second, func() string {
		p, err := client.CoreV1().Pods("default").Get(t.Context(), "p1", metav1.GetOptions{})
		require.NoError(t, err)
		s := p.Annotations["weightd.io/status"]
		sawFetching = sawFetching || strings.HasPrefix(s, "fetching")
		if s != "ready" {
			return "p1: " + s
		}
		return ""
	})
	assert.True(t, sawFetching, "a progress patch came first")
}
