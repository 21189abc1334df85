package adversary

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/warmpool"
)

// Attack 6 of issue 21: any pod labelled weightd.io/warm-server becomes a
// warm server of its node. A tenant that labels its own pod receives other
// tenants' adapters (and their requests, once the agent names the pod in
// their weightd.io/lora-endpoint), and has its base pinned in the node's
// cache whether it serves or not.

const (
	warmNode = "gpu"
	warmBase = "hf://org/base@main"
)

// warmFixture runs the real warm pool and its Kubernetes side for node gpu
// on a real API server; warm servers are LoRA server doubles on loopback.
type warmFixture struct {
	t     *testing.T
	env   *kubetest.Env
	pool  *warmpool.Pool
	bases *recordingBases
}

// recordingBases is the pool's Bases: it records which servers' bases are
// kept (pinned, in the agent) at each moment.
type recordingBases struct {
	mu   sync.Mutex
	kept map[string]bool // pod → kept now
	ever map[string]bool // pod → kept at some point
}

func (b *recordingBases) Keep(_ context.Context, s warmpool.ServerSpec) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.kept[s.Pod], b.ever[s.Pod] = true, true
	return nil
}

func (b *recordingBases) Drop(s warmpool.ServerSpec) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.kept, s.Pod)
}

func (b *recordingBases) state(pod string) (now, ever bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.kept[pod], b.ever[pod]
}

// adapterDirs serves hf://org/NAME@main from root/NAME, as the cache holds
// an adapter after its fetch.
type adapterDirs struct{ root string }

func (f adapterDirs) Fetch(_ context.Context, ref string) (string, error) {
	name, ok := strings.CutPrefix(ref, "hf://org/")
	name, main := strings.CutSuffix(name, "@main")
	if !ok || !main {
		return "", fmt.Errorf("%w: reference %q: not hf://org/NAME@main", api.ErrBadRequest, ref)
	}
	return filepath.Join(f.root, name), nil
}

func newWarmFixture(t *testing.T, opts ...kube.WarmOption) *warmFixture {
	t.Helper()
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	if _, err := env.CreateNode(ctx, warmNode, nil); err != nil {
		t.Fatal(err)
	}
	for _, ns := range []string{"inference", "tenant-a", "tenant-b", "rogue"} {
		if err := env.EnsureNamespace(ctx, ns); err != nil {
			t.Fatal(err)
		}
	}
	adapters := t.TempDir()
	for _, name := range []string{"sql-lora", "chat-lora"} {
		if err := loratest.WriteAdapter(filepath.Join(adapters, name), loratest.AdapterSpec{Rank: 8}); err != nil {
			t.Fatal(err)
		}
	}
	bases := &recordingBases{kept: map[string]bool{}, ever: map[string]bool{}}
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	pool, err := warmpool.New(warmpool.Config{
		StageDir: t.TempDir(), Fetcher: adapterDirs{adapters}, Bases: bases,
		HealthInterval: 200 * time.Millisecond, CallTimeout: 5 * time.Second, LoadTimeout: 5 * time.Second,
		Logger: log.With("part", "pool"),
	})
	if err != nil {
		t.Fatal(err)
	}
	w, err := kube.NewWarmPods(env.Clientset(), warmNode, pool, append([]kube.WarmOption{
		kube.WithWarmInterval(100 * time.Millisecond), kube.WithWarmRetry(50*time.Millisecond, 200*time.Millisecond),
		kube.WithWarmLogger(log.With("part", "warm")),
	}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{pool.Run, w.Run} {
		wg.Go(func() {
			if err := run(rctx); err != nil {
				t.Errorf("run: %v", err)
			}
		})
	}
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	return &warmFixture{t: t, env: env, pool: pool, bases: bases}
}

// testWriter sends log lines to the test's log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// server starts a LoRA server double with slots and a warm server pod
// namespace/name for it, running on loopback.
func (f *warmFixture) server(namespace, name string, slots int) *loratest.Server {
	f.t.Helper()
	srv, err := loratest.NewVLLM(loratest.Options{Base: "base", Slots: slots})
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(srv.Close)
	u, err := url.Parse(srv.URL())
	if err != nil {
		f.t.Fatal(err)
	}
	pod := f.pod(namespace, name, map[string]string{
		podrequest.WarmBase: warmBase, podrequest.WarmRuntime: "vllm", podrequest.WarmPort: u.Port(),
		podrequest.WarmSlots: fmt.Sprint(slots),
	})
	pod.Labels = map[string]string{podrequest.WarmServerLabel: "true"}
	f.create(pod)
	pods := f.env.Clientset().CoreV1().Pods(namespace)
	got, err := pods.Get(f.t.Context(), name, metav1.GetOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	got.Status.Phase, got.Status.PodIP = corev1.PodRunning, u.Hostname()
	got.Status.PodIPs = []corev1.PodIP{{IP: u.Hostname()}}
	if _, err := pods.UpdateStatus(f.t.Context(), got, metav1.UpdateOptions{}); err != nil {
		f.t.Fatal(err)
	}
	return srv
}

func (f *warmFixture) pod(namespace, name string, annotations map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Annotations: annotations},
		Spec:       corev1.PodSpec{NodeName: warmNode, Containers: []corev1.Container{{Name: "c", Image: "example.com/c:1"}}},
	}
}

func (f *warmFixture) create(pod *corev1.Pod) {
	f.t.Helper()
	if _, err := f.env.Clientset().CoreV1().Pods(pod.Namespace).Create(f.t.Context(), pod, metav1.CreateOptions{}); err != nil {
		f.t.Fatal(err)
	}
}

// askAdapter creates a pod namespace/name asking for adapter NAME-lora as
// NAME, and waits for the agent's answer.
func (f *warmFixture) askAdapter(namespace, name string) (endpoint, errText string) {
	f.t.Helper()
	f.create(f.pod(namespace, name, map[string]string{
		podrequest.LoraBase: warmBase, podrequest.LoraAdapter: "hf://org/" + name + "-lora", podrequest.LoraName: name,
	}))
	e := f.answer(namespace, name)
	if strings.HasPrefix(e, "http://") {
		return e, ""
	}
	return "", e
}

// answer waits for the agent's answer on pod namespace/name: its endpoint,
// or an error that will not pass by waiting.
func (f *warmFixture) answer(namespace, name string) string {
	f.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		p, err := f.env.Clientset().CoreV1().Pods(namespace).Get(f.t.Context(), name, metav1.GetOptions{})
		if err != nil {
			f.t.Fatal(err)
		}
		if e := p.Annotations[podrequest.LoraEndpoint]; e != "" {
			return e
		}
		if e := p.Annotations[podrequest.LoraError]; e != "" && !strings.HasPrefix(e, "busy") && !strings.HasPrefix(e, "not found") {
			return e
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("pod %s/%s: no adapter answer in 30s (annotations %v)", namespace, name, p.Annotations)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitChecked waits until the pool has checked pod's server (it is healthy
// or says why not).
func (f *warmFixture) waitChecked(pod string, healthy bool) {
	f.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, s := range f.pool.Servers() {
			if s.Pod == pod && s.Healthy == healthy && (healthy || s.Error != "") {
				return
			}
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("warm server %s not seen healthy=%v in 30s: %+v", pod, healthy, f.pool.Servers())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestWarmServerFromAnyNamespace: the operator lets namespace inference
// hold warm servers shared by every namespace, and tenant-b warm servers of
// its own. A pod of namespace rogue that labels itself a warm server (with
// the most free slots) gets no tenant's adapter, no pin, and an Event
// saying why; tenant-a's adapter goes to the shared server, tenant-b's to
// its own.
func TestWarmServerFromAnyNamespace(t *testing.T) {
	f := newWarmFixture(t, kube.WithWarmSharedNamespaces("inference"), kube.WithWarmServerNamespaces("tenant-b"))
	shared := f.server("inference", "vllm", 1)
	own := f.server("tenant-b", "vllm", 4)
	rogue := f.server("rogue", "vllm", 8)

	endpoint, errText := f.askAdapter("tenant-a", "sql")
	if endpoint != shared.URL() {
		t.Errorf("tenant-a's adapter: endpoint %q (error %q), want the shared server %s (the rogue one is %s)", endpoint, errText, shared.URL(), rogue.URL())
	}
	endpoint, errText = f.askAdapter("tenant-b", "chat")
	if endpoint != own.URL() {
		t.Errorf("tenant-b's adapter: endpoint %q (error %q), want its own server %s (the rogue one is %s)", endpoint, errText, own.URL(), rogue.URL())
	}
	// A name another tenant's adapter holds is refused without naming
	// that adapter, which may be private.
	f.create(f.pod("tenant-b", "squat", map[string]string{
		podrequest.LoraBase: warmBase, podrequest.LoraAdapter: "hf://org/chat-lora", podrequest.LoraName: "sql",
	}))
	errText = f.answer("tenant-b", "squat")
	if !strings.Contains(errText, "already serves") || strings.Contains(errText, "sql-lora") {
		t.Errorf("tenant-b asking for name sql, held by tenant-a's adapter: error %q, want refused without naming tenant-a's adapter", errText)
	}
	if n := rogue.Loads("sql") + rogue.Loads("chat"); n != 0 {
		t.Errorf("the rogue server was given %d adapters of other tenants", n)
	}
	if _, ever := f.bases.state("rogue/vllm"); ever {
		t.Error("the rogue server's base was pinned")
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		evs, err := f.env.Clientset().CoreV1().Events("rogue").List(t.Context(), metav1.ListOptions{
			FieldSelector: "involvedObject.name=vllm,reason=" + kube.ReasonWarmServerNotAllowed,
		})
		if err == nil && len(evs.Items) > 0 {
			t.Logf("Event on rogue/vllm: %s", evs.Items[0].Message)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s Event on rogue/vllm in 30s (%v)", kube.ReasonWarmServerNotAllowed, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestWarmPinUnhealthyServer: a warm server pod that does not serve (its
// runtime does not answer) gets no pin for its base; once it serves it
// does, and when it stops serving the pin goes.
func TestWarmPinUnhealthyServer(t *testing.T) {
	f := newWarmFixture(t, kube.WithWarmSharedNamespaces("inference"))
	f.server("inference", "up", 1)
	down := f.server("inference", "down", 1)
	down.Kill()
	f.waitChecked("inference/up", true)
	f.waitChecked("inference/down", false)
	// Two more rounds of checks: Run keeps bases at the start of each.
	for range 2 {
		f.waitChecked("inference/down", false)
		time.Sleep(200 * time.Millisecond)
	}
	if now, _ := f.bases.state("inference/up"); !now {
		t.Error("the healthy server's base is not pinned")
	}
	if _, ever := f.bases.state("inference/down"); ever {
		t.Fatal("the base of a warm server that does not answer was pinned")
	}
	if err := down.Restart(); err != nil {
		t.Fatal(err)
	}
	waitKept(t, f.bases, "inference/down", true)
	down.Kill()
	waitKept(t, f.bases, "inference/down", false)
}

func waitKept(t *testing.T, b *recordingBases, pod string, want bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if now, _ := b.state(pod); now == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the base of %s: pinned %v after 30s, want %v", pod, !want, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
