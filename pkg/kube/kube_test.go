package kube

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/prefetch"
)

const modelSize = 8 << 20

// hasEvent reports whether events has one starting with prefix.
func hasEvent(events []string, prefix string) bool {
	return slices.ContainsFunc(events, func(e string) bool { return strings.HasPrefix(e, prefix) })
}

// nodeShows reports what is missing from the node for ref to be published
// as ready ("" when nothing).
func nodeShows(t *testing.T, n *corev1.Node, ref string, want bool) string {
	t.Helper()
	label := nodestate.Label(ref)
	if got := n.Labels[label] == nodestate.LabelReady; got != want {
		return fmt.Sprintf("label %s present %t, want %t (labels %v)", label, got, want, n.Labels)
	}
	sum, err := nodestate.Decode(n.Annotations[nodestate.SummaryAnnotation])
	if err != nil {
		return err.Error()
	}
	e, ok := sum.Find(nodestate.Key(ref))
	if want && (!ok || e.State != nodestate.StateReady || e.Bytes != e.Total || e.Total != modelSize || e.Ref != ref) {
		return fmt.Sprintf("summary entry %+v (found %t), want ready %d bytes of %s", e, ok, modelSize, ref)
	}
	if !want && ok {
		return fmt.Sprintf("summary still lists %+v", e)
	}
	return ""
}

// TestPodToReady: a pod bound to the node asks for a model; the agent
// fetches it, answers on the pod (status, Events) and labels the node,
// leaving others' labels alone; a second pod finds it on the node; an
// evicted model loses its label.
func TestPodToReady(t *testing.T) {
	const nodeName = "gpu-1"
	env := startEnv(t, nodeName)
	ref, srv := testOrigin(t, "test/model", 4, modelSize, genmodel.WithBandwidth(4<<20)) // about two seconds
	// Labels of others, one even under weightd's prefix: never touched.
	_, err := env.Clientset().CoreV1().Nodes().Patch(t.Context(), nodeName, types.MergePatchType,
		[]byte(`{"metadata":{"labels":{"team":"a","models.weightd.io/by-hand":"ready"}}}`), metav1.PatchOptions{})
	require.NoError(t, err)
	a := startAgent(t, env, nodeName, cacheDir(t), agentOpts{})

	createPod(t, env, newPod("p1", nodeName, map[string]string{podrequest.Models: ref}))
	createPod(t, env, newPod("elsewhere", "gpu-2", map[string]string{podrequest.Models: ref}))
	createPod(t, env, newPod("plain", nodeName, nil))
	waitStatus(t, env, "p1", "ready", 30*time.Second)
	eventually(t, 10*time.Second, func() string {
		ev := podEvents(t, env, "p1")
		if !hasEvent(ev, "Normal Prefetching: prefetching 1 reference: "+ref) || !hasEvent(ev, "Normal Prefetched: prefetched 8.4 MB in ") {
			return fmt.Sprintf("events %q", ev)
		}
		return ""
	})
	eventually(t, 10*time.Second, func() string { return nodeShows(t, node(t, env, nodeName), ref, true) })
	n := node(t, env, nodeName)
	assert.Equal(t, "a", n.Labels["team"])
	assert.Equal(t, "ready", n.Labels["models.weightd.io/by-hand"])
	assert.Equal(t, nodeName, n.Labels[corev1.LabelHostname])
	assert.Equal(t, 1, a.intake.Tracked(), "only this node's pods that ask for something")
	assert.Empty(t, podStatus(t, env, "elsewhere"))
	assert.Empty(t, podEvents(t, env, "plain"))

	// A second pod: on the node already (a new job, a cache hit, ready
	// within the first status delay): one write of status, one Event.
	before := a.writes.count("/pods/p2")
	createPod(t, env, newPod("p2", nodeName, map[string]string{podrequest.Models: " " + ref + " ,"}))
	waitStatus(t, env, "p2", "ready", 10*time.Second)
	eventually(t, 10*time.Second, func() string {
		if ev := podEvents(t, env, "p2"); !hasEvent(ev, "Normal Prefetched: prefetched 8.4 MB in 0.") {
			return fmt.Sprintf("events %q", ev)
		}
		return ""
	})
	// A cache hit is ready within the first status delay (1 s): one status
	// patch and one Event (two of each on a machine too slow for that).
	assert.LessOrEqual(t, a.writes.count("/pods/p2")-before, 2, "status patches")
	assert.LessOrEqual(t, len(podEvents(t, env, "p2")), 2, "Events")
	assert.Less(t, srv.BytesServed(), int64(modelSize)+64<<10, "the model was downloaded once")

	// Finished or deleted pods are no longer followed.
	require.NoError(t, env.Clientset().CoreV1().Pods("default").Delete(t.Context(), "p1", metav1.DeleteOptions{}))
	eventually(t, 10*time.Second, func() string {
		if n := a.intake.Tracked(); n != 1 {
			return fmt.Sprintf("%d pods tracked", n)
		}
		return ""
	})

	// Evicted: the label and the entry go.
	a.blobs.hidden.Store(true)
	eventually(t, 10*time.Second, func() string { return nodeShows(t, node(t, env, nodeName), ref, false) })
	assert.Equal(t, "ready", node(t, env, nodeName).Labels["models.weightd.io/by-hand"])
}

// TestShared: the intake and WarmPods share one watch of the node's pods,
// and the publisher's watch of the Node and the intake's Events go through
// what they share, as in the agent.
func TestShared(t *testing.T) {
	const nodeName = "gpu-1"
	env := startEnv(t, nodeName)
	ref, _ := testOrigin(t, "test/model", 4, modelSize)
	a := startAgent(t, env, nodeName, cacheDir(t), agentOpts{warm: newFakePool()})

	createPod(t, env, newPod("p1", nodeName, map[string]string{podrequest.Models: ref}))
	waitStatus(t, env, "p1", "ready", 30*time.Second)
	eventually(t, 10*time.Second, func() string {
		if ev := podEvents(t, env, "p1"); !hasEvent(ev, "Normal Prefetched: prefetched ") {
			return fmt.Sprintf("events %q", ev)
		}
		return ""
	})
	eventually(t, 10*time.Second, func() string { return nodeShows(t, node(t, env, nodeName), ref, true) })
	assert.Equal(t, 1, a.writes.watchesOf("/api/v1/pods"), "watches of the node's pods")
	assert.Equal(t, 1, a.writes.watchesOf("/api/v1/nodes"), "watches of the Node")
}

// TestInvalidAnnotation: a malformed annotation is a Warning Event on its
// pod, and nothing else.
func TestInvalidAnnotation(t *testing.T) {
	const nodeName = "gpu-1"
	env := startEnv(t, nodeName)
	ref, _ := testOrigin(t, "test/model", 2, modelSize)
	a := startAgent(t, env, nodeName, cacheDir(t), agentOpts{})

	createPod(t, env, newPod("bad-ref", nodeName, map[string]string{podrequest.Models: "hf://org/name, ftp://host/model"}))
	createPod(t, env, newPod("bad-bool", nodeName, map[string]string{podrequest.PrefetchImages: "yes please"}))
	createPod(t, env, newPod("too-long", nodeName, map[string]string{podrequest.Models: strings.Repeat("hf://org/m,", 1000)}))
	createPod(t, env, newPod("good", nodeName, map[string]string{podrequest.Models: ref}))
	waitStatus(t, env, "good", "ready", 30*time.Second)
	for name, want := range map[string]string{
		"bad-ref":  "annotation weightd.io/models, reference 2",
		"bad-bool": "is not true or false",
		"too-long": "more than 8192",
	} {
		eventually(t, 10*time.Second, func() string {
			ev := podEvents(t, env, name)
			if len(ev) != 1 || !strings.HasPrefix(ev[0], "Warning InvalidAnnotation: ") || !strings.Contains(ev[0], want) {
				return fmt.Sprintf("%s: events %q, want one InvalidAnnotation saying %q", name, ev, want)
			}
			return ""
		})
		assert.Empty(t, podStatus(t, env, name), name)
	}
	// Fixing the annotation takes the pod in.
	_, err := env.Clientset().CoreV1().Pods("default").Patch(t.Context(), "bad-ref", types.MergePatchType,
		[]byte(fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, podrequest.Models, ref)), metav1.PatchOptions{})
	require.NoError(t, err)
	waitStatus(t, env, "bad-ref", "ready", 10*time.Second)
	for _, st := range a.queue.Jobs() {
		assert.Equal(t, ref, st.Ref, "no job for the invalid ones")
	}
}

// TestManyPods: 1,000 annotated pods on the node keep the agent's writes
// bounded per pod and in rate, and its memory small.
func TestManyPods(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 pods")
	}
	const nodeName, pods = "gpu-1", 1000
	const qps, burst = 100, 100
	env := startEnv(t, nodeName)
	refs := make([]string, 4)
	origins := make([]*genmodel.Server, len(refs))
	for i := range refs {
		refs[i], origins[i] = testOrigin(t, fmt.Sprintf("test/model-%d", i), 2, modelSize)
	}
	var m0 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	a := startAgent(t, env, nodeName, cacheDir(t), agentOpts{qps: qps, burst: burst})

	start := time.Now()
	var wg sync.WaitGroup
	next := make(chan int)
	for range 8 {
		wg.Go(func() {
			for i := range next {
				pod := newPod(fmt.Sprintf("p%04d", i), nodeName, map[string]string{podrequest.Models: refs[i%len(refs)]})
				if _, err := env.Clientset().CoreV1().Pods("default").Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
					t.Error(err)
				}
			}
		})
	}
	for i := range pods {
		next <- i
	}
	close(next)
	wg.Wait()
	eventually(t, 3*time.Minute, func() string {
		list, err := env.Clientset().CoreV1().Pods("default").List(t.Context(), metav1.ListOptions{})
		if err != nil {
			return err.Error()
		}
		ready := 0
		for _, p := range list.Items {
			if p.Annotations[podrequest.Status] == "ready" {
				ready++
			}
		}
		if ready != pods {
			return fmt.Sprintf("%d of %d pods ready", ready, pods)
		}
		return ""
	})
	elapsed := time.Since(start)
	for _, ref := range refs {
		eventually(t, 10*time.Second, func() string { return nodeShows(t, node(t, env, nodeName), ref, true) })
	}
	// The Events trail the status patches (the same client, rate limited).
	eventually(t, time.Minute, func() string {
		n := a.writes.count("/events")
		time.Sleep(2 * time.Second)
		if m := a.writes.count("/events"); m != n {
			return fmt.Sprintf("%d Events sent and counting", m)
		}
		return ""
	})
	var m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m1)

	podWrites, events, nodeWrites := a.writes.count("/pods/"), a.writes.count("/events"), a.writes.count("/nodes/")
	t.Logf("%d pods ready in %v: %d status patches, %d Events, %d node writes; at most %d writes in a second; heap %d MiB more",
		pods, elapsed.Round(time.Millisecond), podWrites, events, nodeWrites, a.writes.maxInWindow(time.Second), (int64(m1.HeapAlloc)-int64(m0.HeapAlloc))>>20)
	assert.Equal(t, pods, a.intake.Tracked())
	// Per pod: "queued" or "fetching" at most once or twice, then "ready";
	// Prefetching only for pods that waited, then Prefetched.
	assert.LessOrEqual(t, podWrites, 2*pods)
	assert.LessOrEqual(t, events, 2*pods)
	assert.LessOrEqual(t, nodeWrites, int(elapsed/(200*time.Millisecond))+5, "one node write per interval at most")
	assert.LessOrEqual(t, a.writes.maxInWindow(time.Second), qps+burst, "the client's rate limit holds")
	assert.Less(t, int64(m1.HeapAlloc)-int64(m0.HeapAlloc), int64(64<<20), "heap growth for 1,000 pods")
	assert.GreaterOrEqual(t, events, pods, "a Prefetched Event for every pod")
	for _, srv := range origins {
		assert.Less(t, srv.BytesServed(), int64(modelSize+1<<20), "each model downloaded once, however many pods")
	}
}

// TestAPIServerRestart: while the API server is down the agent keeps
// fetching; when it is back the informers reconnect, later pods are
// answered and the node is labelled.
func TestAPIServerRestart(t *testing.T) {
	const nodeName = "gpu-1"
	env := startEnv(t, nodeName)
	ref1, _ := testOrigin(t, "test/model-1", 2, modelSize)
	ref2, _ := testOrigin(t, "test/model-2", 2, modelSize)
	ref3, _ := testOrigin(t, "test/model-3", 2, modelSize)
	a := startAgent(t, env, nodeName, cacheDir(t), agentOpts{})
	createPod(t, env, newPod("p1", nodeName, map[string]string{podrequest.Models: ref1}))
	waitStatus(t, env, "p1", "ready", 30*time.Second)

	require.NoError(t, env.StopAPIServer())
	j, err := a.queue.Submit(ref2, prefetch.PriorityNormal)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, err := j.Wait(ctx)
	require.NoError(t, err, "the queue and cache work without the API server")
	assert.Equal(t, prefetch.StateReady, st.State)
	time.Sleep(2 * time.Second) // the publisher fails to write meanwhile, and goes on
	require.NoError(t, env.StartAPIServer(t.Context()))

	createPod(t, env, newPod("p3", nodeName, map[string]string{podrequest.Models: ref3}))
	waitStatus(t, env, "p3", "ready", 60*time.Second)
	for _, ref := range []string{ref1, ref2, ref3} {
		eventually(t, 20*time.Second, func() string { return nodeShows(t, node(t, env, nodeName), ref, true) })
	}
}

// TestAgentRestart: a new agent on the same cache rebuilds the node's state
// from the API and the cache: the summary's references are resubmitted at
// background priority and the pods' again, with no second download, no
// status patch and no Event for pods already answered.
func TestAgentRestart(t *testing.T) {
	const nodeName = "gpu-1"
	env := startEnv(t, nodeName)
	ref1, srv1 := testOrigin(t, "test/model-1", 2, modelSize)
	ref2, srv2 := testOrigin(t, "test/model-2", 2, modelSize)
	root := cacheDir(t)
	a1 := startAgent(t, env, nodeName, root, agentOpts{})
	createPod(t, env, newPod("p1", nodeName, map[string]string{podrequest.Models: ref1}))
	createPod(t, env, newPod("p2", nodeName, map[string]string{podrequest.Models: ref2}))
	waitStatus(t, env, "p1", "ready", 30*time.Second)
	waitStatus(t, env, "p2", "ready", 30*time.Second)
	for _, ref := range []string{ref1, ref2} {
		eventually(t, 10*time.Second, func() string { return nodeShows(t, node(t, env, nodeName), ref, true) })
	}
	eventually(t, 10*time.Second, func() string {
		if ev := podEvents(t, env, "p2"); !hasEvent(ev, "Normal Prefetched: ") {
			return fmt.Sprintf("events %q", ev)
		}
		return ""
	})
	events := len(podEvents(t, env, "p2"))
	a1.stop()
	// p1 goes while the agent is down: only the node's summary remembers
	// its model.
	require.NoError(t, env.Clientset().CoreV1().Pods("default").Delete(t.Context(), "p1", metav1.DeleteOptions{}))
	served1, served2 := srv1.BytesServed(), srv2.BytesServed()

	a2 := startAgent(t, env, nodeName, root, agentOpts{})
	eventually(t, 30*time.Second, func() string {
		// ref2 is asked for by the summary and by p2: one job, at whichever
		// priority came first.
		ready := map[string]prefetch.Priority{}
		for _, st := range a2.queue.Jobs() {
			if st.State == prefetch.StateReady {
				ready[st.Ref] = st.Priority
			}
		}
		if p, ok := ready[ref1]; len(ready) != 2 || !ok || p != prefetch.PriorityBackground {
			return fmt.Sprintf("ready jobs %v, want %s at background and %s", ready, ref1, ref2)
		}
		if _, ok := ready[ref2]; !ok {
			return fmt.Sprintf("ready jobs %v, want %s too", ready, ref2)
		}
		return ""
	})
	time.Sleep(time.Second) // a few publisher intervals
	for _, ref := range []string{ref1, ref2} {
		assert.Empty(t, nodeShows(t, node(t, env, nodeName), ref, true))
	}
	assert.Less(t, srv1.BytesServed()-served1, int64(64<<10), "no second download of model 1: its manifest only")
	assert.Less(t, srv2.BytesServed()-served2, int64(64<<10), "no second download of model 2: its manifest only")
	assert.Equal(t, "ready", podStatus(t, env, "p2"))
	assert.Zero(t, a2.writes.count("/pods/"), "no status patch for an answered pod")
	assert.Zero(t, a2.writes.count("/events"), "no Event again")
	assert.Len(t, podEvents(t, env, "p2"), events)
}
