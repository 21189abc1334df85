package kube

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/api"
	wcache "github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/warmpool"
)

// fakePool is a warm pool that loads any adapter at once on the first
// server of its base, and records what it is asked.
type fakePool struct {
	mu       sync.Mutex
	sets     [][]warmpool.ServerSpec
	loaded   map[string][]string // server pod → adapter names
	owners   map[string]string   // owner → adapter name
	ensures  map[string]int      // adapter ref → EnsureFor calls
	released []string
	fail     map[string]error // adapter ref → error of EnsureFor
	changed  chan struct{}
}

func newFakePool() *fakePool {
	return &fakePool{
		loaded: map[string][]string{}, owners: map[string]string{}, ensures: map[string]int{},
		fail: map[string]error{}, changed: make(chan struct{}, 1),
	}
}

func (f *fakePool) notify() {
	select {
	case f.changed <- struct{}{}:
	default:
	}
}

func (f *fakePool) SetServers(specs []warmpool.ServerSpec) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sets = append(f.sets, specs)
	f.notify()
}

func (f *fakePool) EnsureFor(_ context.Context, owner string, req api.AdapterRequest) (api.AdapterAnswer, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ensures[req.Ref]++
	if err := f.fail[req.Ref]; err != nil {
		return api.AdapterAnswer{}, err
	}
	name := req.Name
	if name == "" {
		name = warmpool.AdapterName(req.Ref)
	}
	for _, s := range f.last() {
		if s.Base != req.Base {
			continue
		}
		f.owners[owner] = name
		loaded := !slices.Contains(f.loaded[s.Pod], name)
		if loaded {
			f.loaded[s.Pod] = append(f.loaded[s.Pod], name)
			f.notify()
		}
		return api.AdapterAnswer{Server: s.Pod, Endpoint: s.Endpoint, Model: name, Loaded: loaded, Seconds: 0.08}, nil
	}
	return api.AdapterAnswer{}, fmt.Errorf("%w: no warm server of base %s on this node", api.ErrNotFound, req.Base)
}

func (f *fakePool) Release(owner string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.released = append(f.released, owner)
	delete(f.owners, owner)
}

func (f *fakePool) Servers() []api.WarmServer {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []api.WarmServer
	for _, s := range f.last() {
		ws := api.WarmServer{Pod: s.Pod, Base: s.Base, Runtime: string(s.Runtime), Endpoint: s.Endpoint, Healthy: true, Slots: s.Slots}
		for _, name := range f.loaded[s.Pod] {
			ws.Adapters = append(ws.Adapters, api.LoadedAdapter{Name: name})
		}
		out = append(out, ws)
	}
	return out
}

func (f *fakePool) Changed() <-chan struct{} { return f.changed }

// last is the servers last set. f.mu is held.
func (f *fakePool) last() []warmpool.ServerSpec {
	if len(f.sets) == 0 {
		return nil
	}
	return f.sets[len(f.sets)-1]
}

func (f *fakePool) lastSet() ([]warmpool.ServerSpec, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.last()), len(f.sets)
}

func (f *fakePool) calls(ref string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ensures[ref]
}

func (f *fakePool) setFail(ref string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail[ref] = err
}

func (f *fakePool) wasReleased(owner types.UID) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Contains(f.released, string(owner))
}

// noJobs is a prefetch queue with no job, for a publisher of warm bases only.
type noJobs struct{}

func (noJobs) Submit(string, prefetch.Priority, ...prefetch.SubmitOption) (*prefetch.Job, error) {
	return nil, errors.New("no jobs here")
}
func (noJobs) Jobs() []prefetch.JobStatus       { return nil }
func (noJobs) Job(string) (*prefetch.Job, bool) { return nil, false }

// since lists the writes after the first n.
func (c *writeCounter) since(n int) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.what[min(n, len(c.what)):])
}

// countingClient is a client of env whose writes are counted.
func countingClient(t *testing.T, env *kubetest.Env) (kubernetes.Interface, *writeCounter) {
	t.Helper()
	w := &writeCounter{}
	cfg := rest.CopyConfig(env.Config)
	cfg.QPS, cfg.Burst = 50, 100
	cfg.Wrap(w.wrap)
	client, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return client, w
}

// runWarm runs WarmPods (and a node publisher of the pool's warm bases) for
// node until the returned stop, or the end of the test.
func runWarm(t *testing.T, env *kubetest.Env, node string, pool WarmPool) (stop func(), writes *writeCounter) {
	t.Helper()
	client, writes := countingClient(t, env)
	w, err := NewWarmPods(client, node, pool, WithWarmInterval(100*time.Millisecond),
		WithWarmRetry(50*time.Millisecond, 200*time.Millisecond), WithWarmLogger(testLogger(t)),
		WithWarmServerNamespaces("default"))
	require.NoError(t, err)
	pub, err := NewNodePublisher(client, node, noJobs{}, nil, WithNodeInterval(100*time.Millisecond, time.Second),
		WithWarmBases(w.Bases), WithPublisherLogger(testLogger(t)))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{w.Run, pub.Run} {
		wg.Go(func() {
			if err := run(ctx); err != nil {
				t.Errorf("run: %v", err)
			}
		})
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
		})
	}
	t.Cleanup(stop)
	return stop, writes
}

// warmServerPod is a warm server pod on node with annotations.
func warmServerPod(name, node string, annotations map[string]string) *corev1.Pod {
	pod := newPod(name, node, annotations)
	pod.Labels = map[string]string{podrequest.WarmServerLabel: "true"}
	return pod
}

// setRunning marks a pod running with ip, through the status subresource
// (the kubelet's part).
func setRunning(t *testing.T, env *kubetest.Env, name, ip string) {
	t.Helper()
	pods := env.Clientset().CoreV1().Pods("default")
	pod, err := pods.Get(t.Context(), name, metav1.GetOptions{})
	require.NoError(t, err)
	pod.Status.Phase = corev1.PodRunning
	pod.Status.PodIP = ip
	pod.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	_, err = pods.UpdateStatus(t.Context(), pod, metav1.UpdateOptions{})
	require.NoError(t, err)
}

func getPod(t *testing.T, env *kubetest.Env, name string) *corev1.Pod {
	t.Helper()
	pod, err := env.Clientset().CoreV1().Pods("default").Get(t.Context(), name, metav1.GetOptions{})
	require.NoError(t, err)
	return pod
}

// waitAnnotations waits for the pod to show want (an empty value: absent).
func waitAnnotations(t *testing.T, env *kubetest.Env, name string, want map[string]string) {
	t.Helper()
	eventually(t, 10*time.Second, func() string {
		got := getPod(t, env, name).Annotations
		for k, v := range want {
			if have, ok := got[k]; have != v || ok != (v != "") {
				return fmt.Sprintf("pod %s: annotation %s = %q (present %t), want %q", name, k, have, ok, v)
			}
		}
		return ""
	})
}

// waitEvent waits for an Event of the pod starting with prefix.
func waitEvent(t *testing.T, env *kubetest.Env, name, prefix string) {
	t.Helper()
	eventually(t, 10*time.Second, func() string {
		if ev := podEvents(t, env, name); !hasEvent(ev, prefix) {
			return fmt.Sprintf("pod %s: events %q, want one starting %q", name, ev, prefix)
		}
		return ""
	})
}

// TestWarmPods runs the warm pool's Kubernetes side against a real API
// server with a fake pool: discovery of warm servers from pod objects,
// malformed descriptions reported and skipped, adapter requests answered
// on their pods, retried when a server of their base comes, released when
// their pod goes, loaded adapters on the server pods, warm-base labels on
// the node, and no write when nothing changed, across a restart too.
//
// The intake's weightd_pod_prefetch_ready_seconds is checked on the same
// API server.
func TestWarmPods(t *testing.T) {
	const nodeName = "gpu-warm"
	env := startEnv(t, nodeName)
	t.Run("warm", func(t *testing.T) { testWarmPods(t, env, nodeName) })
	t.Run("prefetch-ready-seconds", func(t *testing.T) { testPodPrefetchReadySeconds(t, env, nodeName) })
	t.Run("example-accepted", func(t *testing.T) { testExampleWarmAccepted(t, env) })
	t.Run("real-pool", func(t *testing.T) { testRealPool(t, env) })
}

func testWarmPods(t *testing.T, env *kubetest.Env, nodeName string) {
	const base = "hf://Qwen/Qwen2.5-7B-Instruct@main"
	const base2 = "hf://org/other-base@main"
	_, err := env.CreateNode(t.Context(), "gpu-other", nil)
	require.NoError(t, err)
	pool := newFakePool()
	stop, writes := runWarm(t, env, nodeName, pool)

	server := func(base, port string) map[string]string {
		return map[string]string{
			podrequest.WarmBase: base, podrequest.WarmRuntime: "vllm", podrequest.WarmPort: port,
			podrequest.WarmSlots: "4", podrequest.WarmMaxRank: "64",
		}
	}
	// Discovery: running pods with an IP only; others' nodes never.
	createPod(t, env, warmServerPod("vllm-a", nodeName, server(base, "8000")))
	createPod(t, env, warmServerPod("vllm-b", nodeName, server(base2, "8001")))
	createPod(t, env, warmServerPod("elsewhere", "gpu-other", server(base, "8000")))
	bad := server(base, "8000")
	bad[podrequest.WarmRuntime] = "tgi"
	createPod(t, env, warmServerPod("bad-runtime", nodeName, bad))
	setRunning(t, env, "vllm-a", "10.0.0.5")
	setRunning(t, env, "bad-runtime", "10.0.0.6")
	setRunning(t, env, "elsewhere", "10.0.1.5")
	want := warmpool.ServerSpec{
		Pod: "default/vllm-a", UID: string(getPod(t, env, "vllm-a").UID), Base: base, Runtime: "vllm",
		Endpoint: "http://10.0.0.5:8000", Slots: 4, MaxRank: 64,
	}
	eventually(t, 10*time.Second, func() string {
		if specs, _ := pool.lastSet(); !slices.Equal(specs, []warmpool.ServerSpec{want}) {
			return fmt.Sprintf("servers %+v, want %+v", specs, want)
		}
		return ""
	})
	waitEvent(t, env, "bad-runtime", `Warning InvalidAnnotation: invalid argument: annotation weightd.io/runtime: "tgi" is not vllm or sglang`)

	// The node is labelled for the warm base.
	eventually(t, 10*time.Second, func() string {
		if l := node(t, env, nodeName).Labels; l[nodestate.WarmLabel(base)] != "ready" || l[nodestate.WarmLabel(base2)] != "" {
			return fmt.Sprintf("node labels %v, want %s=ready only", l, nodestate.WarmLabel(base))
		}
		return ""
	})

	// A pod asks for an adapter: answered on the pod, with an Event; the
	// server pod lists it.
	const adapter = "hf://org/sql-lora@v1"
	createPod(t, env, newPod("client", nodeName, map[string]string{
		podrequest.LoraBase: base, podrequest.LoraAdapter: adapter, podrequest.LoraName: "sql",
	}))
	waitAnnotations(t, env, "client", map[string]string{
		podrequest.LoraEndpoint: "http://10.0.0.5:8000", podrequest.LoraModel: "sql", podrequest.LoraError: "",
	})
	waitEvent(t, env, "client", `Normal AdapterReady: adapter hf://org/sql-lora@v1 is model "sql" on default/vllm-a at http://10.0.0.5:8000 (loaded in 0.1 s)`)
	waitAnnotations(t, env, "vllm-a", map[string]string{nodestate.LoadedAdaptersAnnotation: `["sql"]`})

	// A base no server has: the error, then the answer once one comes
	// (the second server gets its IP).
	const adapter2 = "hf://org/chat-lora@main"
	createPod(t, env, newPod("client2", nodeName, map[string]string{podrequest.LoraBase: base2, podrequest.LoraAdapter: adapter2}))
	waitAnnotations(t, env, "client2", map[string]string{
		podrequest.LoraError: "not found: no warm server of base " + base2 + " on this node",
	})
	waitEvent(t, env, "client2", "Warning AdapterFailed: adapter hf://org/chat-lora@main: not found: no warm server")
	setRunning(t, env, "vllm-b", "10.0.0.7")
	name2 := warmpool.AdapterName(adapter2)
	waitAnnotations(t, env, "client2", map[string]string{
		podrequest.LoraEndpoint: "http://10.0.0.7:8001", podrequest.LoraModel: name2, podrequest.LoraError: "",
	})
	waitAnnotations(t, env, "vllm-b", map[string]string{nodestate.LoadedAdaptersAnnotation: `["` + name2 + `"]`})
	eventually(t, 10*time.Second, func() string {
		if l := node(t, env, nodeName).Labels; l[nodestate.WarmLabel(base2)] != "ready" {
			return fmt.Sprintf("node labels %v, want %s=ready", l, nodestate.WarmLabel(base2))
		}
		return ""
	})

	// An adapter the pool refuses for good: the error, not retried.
	const badAdapter = "hf://org/rank-too-big@main"
	pool.setFail(badAdapter, fmt.Errorf("%w: adapter rank 256 exceeds the servers' maximum 64", api.ErrBadRequest))
	createPod(t, env, newPod("client3", nodeName, map[string]string{podrequest.LoraBase: base, podrequest.LoraAdapter: badAdapter}))
	waitAnnotations(t, env, "client3", map[string]string{
		podrequest.LoraError: "bad request: adapter rank 256 exceeds the servers' maximum 64", podrequest.LoraEndpoint: "",
	})
	// A pool that is busy: retried with backoff until it is not.
	const busyAdapter = "hf://org/busy@main"
	pool.setFail(busyAdapter, fmt.Errorf("%w: every slot is in use", api.ErrBusy))
	createPod(t, env, newPod("client4", nodeName, map[string]string{podrequest.LoraBase: base, podrequest.LoraAdapter: busyAdapter}))
	waitAnnotations(t, env, "client4", map[string]string{podrequest.LoraError: "busy: every slot is in use"})
	eventually(t, 10*time.Second, func() string {
		if n := pool.calls(busyAdapter); n < 3 {
			return fmt.Sprintf("%d ensures of a busy adapter, want retries", n)
		}
		return ""
	})
	pool.setFail(busyAdapter, nil)
	waitAnnotations(t, env, "client4", map[string]string{podrequest.LoraModel: warmpool.AdapterName(busyAdapter), podrequest.LoraError: ""})
	assert.Equal(t, 1, pool.calls(badAdapter), "a bad request is not asked again")

	// A malformed request: an Event and the error on the pod, no ensure.
	createPod(t, env, newPod("client5", nodeName, map[string]string{podrequest.LoraBase: base, podrequest.LoraName: "x"}))
	waitAnnotations(t, env, "client5", map[string]string{
		podrequest.LoraError: "invalid annotation: invalid argument: annotation weightd.io/lora-adapter is missing (weightd.io/lora-base and weightd.io/lora-adapter go together)",
	})
	waitEvent(t, env, "client5", "Warning InvalidAnnotation: invalid argument: annotation weightd.io/lora-adapter is missing")

	// Settled: nothing more is written, even when the pool says it changed
	// and the servers are compared again.
	time.Sleep(500 * time.Millisecond) // the last Events and writes land
	before := writes.count("")
	pool.mu.Lock()
	pool.notify()
	pool.mu.Unlock()
	time.Sleep(time.Second) // ten intervals
	assert.Equal(t, before, writes.count(""), "writes when nothing changed: %v", writes.since(before))

	// The client pod goes: its adapter is released.
	uid := getPod(t, env, "client").UID
	require.NoError(t, env.Clientset().CoreV1().Pods("default").Delete(t.Context(), "client", metav1.DeleteOptions{}))
	eventually(t, 10*time.Second, func() string {
		if !pool.wasReleased(uid) {
			return "the deleted pod's adapter is not released"
		}
		return ""
	})

	// A restart of the agent: every request is ensured again (the pool
	// learns its users again), with no write.
	stop()
	calls := pool.calls(adapter2)
	_, sets := pool.lastSet()
	pool2 := newFakePool()
	pool2.mu.Lock()
	pool2.loaded = pool.loaded // the servers keep their adapters
	pool2.mu.Unlock()
	pool2.setFail(badAdapter, fmt.Errorf("%w: adapter rank 256 exceeds the servers' maximum 64", api.ErrBadRequest))
	_, writes2 := runWarm(t, env, nodeName, pool2)
	eventually(t, 10*time.Second, func() string {
		if pool2.calls(adapter2) != 1 || pool2.calls(busyAdapter) != 1 || pool2.calls(badAdapter) != 1 {
			return fmt.Sprintf("ensures after a restart: %d %d %d", pool2.calls(adapter2), pool2.calls(busyAdapter), pool2.calls(badAdapter))
		}
		return ""
	})
	specs, _ := pool2.lastSet()
	assert.Len(t, specs, 2)
	time.Sleep(time.Second)
	// Only the malformed server's Event again: this process cannot know it
	// was reported.
	assert.Equal(t, writes2.count("/events"), writes2.count(""), "writes after a restart: %v", writes2.since(0))
	assert.LessOrEqual(t, writes2.count("/events"), 1, "Events after a restart: %v", writes2.since(0))
	assert.GreaterOrEqual(t, calls, 2, "adapter 2 was ensured until it had a server")
	assert.GreaterOrEqual(t, sets, 2)

	// A server that is no longer one loses its annotation.
	_, err = env.Clientset().CoreV1().Pods("default").Patch(t.Context(), "vllm-b", types.MergePatchType,
		[]byte(`{"metadata":{"labels":{"weightd.io/warm-server":null}}}`), metav1.PatchOptions{})
	require.NoError(t, err)
	waitAnnotations(t, env, "vllm-b", map[string]string{nodestate.LoadedAdaptersAnnotation: ""})
	eventually(t, 10*time.Second, func() string {
		if l := node(t, env, nodeName).Labels; l[nodestate.WarmLabel(base2)] != "" {
			return fmt.Sprintf("node labels %v, want no %s", l, nodestate.WarmLabel(base2))
		}
		return ""
	})
	waitAnnotations(t, env, "client2", map[string]string{
		podrequest.LoraError: "not found: no warm server of base " + base2 + " on this node", podrequest.LoraEndpoint: "", podrequest.LoraModel: "",
	})
}

// testPodPrefetchReadySeconds: the intake observes, once per pod, the time
// from taking a pod to all its references ready.
func testPodPrefetchReadySeconds(t *testing.T, env *kubetest.Env, nodeName string) {
	r, _ := testOrigin(t, "test/model", 2, modelSize)
	store, err := wcache.Open(cacheDir(t), wcache.WithChunkSize(1<<20))
	require.NoError(t, err)
	defer store.Close()
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	reg := prometheus.NewRegistry()
	client, _ := countingClient(t, env)
	in, err := NewPodIntake(client, nodeName, queue, WithIntakeRegisterer(reg), WithStatusInterval(100*time.Millisecond, 0))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{queue.Run, in.Run} {
		wg.Go(func() { assert.NoError(t, run(ctx)) })
	}
	defer wg.Wait()
	defer cancel()

	createPod(t, env, newPod("m1", nodeName, map[string]string{podrequest.Models: r}))
	createPod(t, env, newPod("m2", nodeName, map[string]string{podrequest.Models: r}))
	waitStatus(t, env, "m1", "ready", 30*time.Second)
	waitStatus(t, env, "m2", "ready", 30*time.Second)
	eventually(t, 10*time.Second, func() string {
		n, err := testutil.GatherAndCount(reg, "weightd_pod_prefetch_ready_seconds")
		if err != nil {
			return err.Error()
		}
		got, err := reg.Gather()
		if err != nil {
			return err.Error()
		}
		if n != 1 || got[0].GetMetric()[0].GetHistogram().GetSampleCount() != 2 {
			return fmt.Sprintf("histogram %v, want 2 samples", got)
		}
		return ""
	})
}
