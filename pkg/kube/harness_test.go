package kube

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/kubetest"
	wcache "github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

// writeCounter counts the write requests (anything but GET) a client sends,
// and the watches it opens.
type writeCounter struct {
	mu      sync.Mutex
	times   []time.Time
	what    []string
	watches []string // paths
}

func (c *writeCounter) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		c.mu.Lock()
		if r.Method != http.MethodGet {
			c.times = append(c.times, time.Now())
			c.what = append(c.what, r.Method+" "+r.URL.Path)
		} else if r.URL.Query().Get("watch") == "true" {
			c.watches = append(c.watches, r.URL.Path)
		}
		c.mu.Unlock()
		return rt.RoundTrip(r)
	})
}

// watchesOf returns how many watches were opened on path.
func (c *writeCounter) watchesOf(path string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(slices.DeleteFunc(slices.Clone(c.watches), func(p string) bool { return p != path }))
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// count returns how many writes went to paths containing part ("" for all).
func (c *writeCounter) count(part string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, w := range c.what {
		if strings.Contains(w, part) {
			n++
		}
	}
	return n
}

// maxInWindow is the most writes in any window of length d.
func (c *writeCounter) maxInWindow(d time.Duration) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	best, j := 0, 0
	for i := range c.times {
		for c.times[i].Sub(c.times[j]) >= d {
			j++
		}
		best = max(best, i-j+1)
	}
	return best
}

// hidingBlobs is a cache whose blobs can be made to vanish, as eviction
// would.
type hidingBlobs struct {
	store  *wcache.Store
	hidden atomic.Bool
}

func (h *hidingBlobs) Stat(d digest.Digest) (wcache.Info, error) {
	if h.hidden.Load() {
		return wcache.Info{}, content.ErrNotFound
	}
	return h.store.Stat(d)
}

// testOrigin serves a generated model and returns its reference.
func testOrigin(t *testing.T, name string, files int, size int64, opts ...genmodel.ServerOption) (string, *genmodel.Server) {
	t.Helper()
	dir := t.TempDir()
	if _, err := genmodel.Generate(dir, genmodel.Spec{Name: name, Files: files, TotalBytes: size, Seed: 7}); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := genmodel.NewServer(ln, dir, opts...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return srv.URL() + "/" + genmodel.ManifestName, srv
}

// agent is the part of a weightd agent this package deals with: a cache, a
// prefetch queue, the pod intake and the node publisher, on a real API
// server through a client whose writes are counted.
type agent struct {
	root   string
	store  *wcache.Store
	blobs  *hidingBlobs
	queue  *prefetch.Queue
	intake *PodIntake
	pub    *NodePublisher
	writes *writeCounter
	stop   func()
}

type agentOpts struct {
	qps   float32
	burst int
	// warm, when set, adds WarmPods over it, and the components share one
	// Shared, as in the agent.
	warm WarmPool
}

// startAgent runs an agent for node with its cache in root until stop (or
// the end of the test).
func startAgent(t *testing.T, env *kubetest.Env, node, root string, o agentOpts) *agent {
	t.Helper()
	a := &agent{root: root, writes: &writeCounter{}}
	cfg := rest.CopyConfig(env.Config)
	cfg.QPS, cfg.Burst = 50, 100
	if o.qps > 0 {
		cfg.QPS, cfg.Burst = o.qps, o.burst
	}
	cfg.Wrap(a.writes.wrap)
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if a.store, err = wcache.Open(root, wcache.WithChunkSize(1<<20)); err != nil {
		t.Fatal(err)
	}
	a.blobs = &hidingBlobs{store: a.store}
	a.queue = prefetch.NewQueue(a.store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)},
		prefetch.WithResolveRetries(1, 0))
	var shared *Shared
	if o.warm != nil {
		shared = NewShared(client, node)
	}
	if a.intake, err = NewPodIntake(client, node, a.queue,
		WithStatusInterval(200*time.Millisecond, 500*time.Millisecond), WithIntakeLogger(testLogger(t)), WithIntakeShared(shared)); err != nil {
		t.Fatal(err)
	}
	if a.pub, err = NewNodePublisher(client, node, a.queue, a.blobs, WithNodeInterval(200*time.Millisecond, time.Second),
		WithPublisherLogger(testLogger(t)), WithPublisherShared(shared)); err != nil {
		t.Fatal(err)
	}
	runs := []func(context.Context) error{a.queue.Run, a.intake.Run, a.pub.Run}
	if o.warm != nil {
		w, err := NewWarmPods(client, node, o.warm, WithWarmLogger(testLogger(t)), WithWarmShared(shared))
		if err != nil {
			t.Fatal(err)
		}
		runs = append(runs, w.Run)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, run := range runs {
		wg.Go(func() {
			if err := run(ctx); err != nil {
				t.Errorf("run: %v", err)
			}
		})
	}
	var once sync.Once
	a.stop = func() {
		once.Do(func() {
			cancel()
			wg.Wait()
			if shared != nil {
				shared.Close()
			}
			a.store.Close()
		})
	}
	t.Cleanup(a.stop)
	return a
}

// startEnv starts an API server with one node.
func startEnv(t *testing.T, node string) *kubetest.Env {
	t.Helper()
	env := kubetest.NewT(t, kubetest.Config{})
	if _, err := env.CreateNode(t.Context(), node, nil); err != nil {
		t.Fatal(err)
	}
	return env
}

// newPod is a pod bound to node with annotations.
func newPod(name, node string, annotations map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Annotations: annotations},
		Spec: corev1.PodSpec{
			NodeName:   node,
			Containers: []corev1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}},
		},
	}
}

func createPod(t *testing.T, env *kubetest.Env, pod *corev1.Pod) {
	t.Helper()
	if _, err := env.Clientset().CoreV1().Pods(pod.Namespace).Create(t.Context(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// eventually polls cond every 50ms until it returns "" or timeout passes,
// then fails with its last answer.
func eventually(t *testing.T, timeout time.Duration, cond func() string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		why := cond()
		if why == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", timeout, why)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// podStatus is the pod's status annotation.
func podStatus(t *testing.T, env *kubetest.Env, name string) string {
	t.Helper()
	pod, err := env.Clientset().CoreV1().Pods("default").Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		return "error: " + err.Error()
	}
	return pod.Annotations["weightd.io/status"]
}

// waitStatus waits for the pod's status annotation to be want.
func waitStatus(t *testing.T, env *kubetest.Env, name, want string, timeout time.Duration) {
	t.Helper()
	eventually(t, timeout, func() string {
		if got := podStatus(t, env, name); got != want {
			return fmt.Sprintf("pod %s status %q, want %q", name, got, want)
		}
		return ""
	})
}

// podEvents lists the events of a pod: "Type Reason: message".
func podEvents(t *testing.T, env *kubetest.Env, name string) []string {
	t.Helper()
	list, err := env.Clientset().CoreV1().Events("default").List(t.Context(), metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", name).String(),
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range list.Items {
		out = append(out, e.Type+" "+e.Reason+": "+e.Message)
	}
	return out
}

func node(t *testing.T, env *kubetest.Env, name string) *corev1.Node {
	t.Helper()
	n, err := env.Clientset().CoreV1().Nodes().Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func cacheDir(t *testing.T) string { return filepath.Join(t.TempDir(), "cache") }

// testLogger logs to the test's output with -v and WEIGHTD_TEST_LOG=1.
func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("WEIGHTD_TEST_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
