// Command kubewrites measures how often a weightd agent writes to the
// Kubernetes API server while a pod's model downloads: the bar is at most 20
// writes per node per minute, however fast chunks arrive.
//
// It starts a real etcd and kube-apiserver (internal/kubetest; built on the
// first run, about ten minutes), registers a Node, and runs an agent for it
// in this process, wired like `weightd agent --kubeconfig` with the default
// intervals and rate limits: a cache, a prefetch queue, the pod intake and
// the node publisher (pkg/kube), its client wrapped in a RoundTripper that
// counts every request that is not a GET. An origin (internal/genmodel) serves a
// generated model of --size, throttled so that it takes about --seconds. It
// creates a pod bound to the node asking for the model and counts the
// agent's writes (status patches, Events, node applies) from then until the
// pod's status is ready and the node is labelled. It prints the breakdown on
// stderr and one JSON line:
//
//	{"bench":"kube-writes","writes_per_min":…,"writes":…,"size_bytes":…,"seconds":…}
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

type result struct {
	Bench        string  `json:"bench"`
	WritesPerMin float64 `json:"writes_per_min"`
	Writes       int     `json:"writes"`
	SizeBytes    int64   `json:"size_bytes"`
	Seconds      float64 `json:"seconds"`
}

// counter counts write requests by method and resource.
type counter struct {
	mu   sync.Mutex
	on   bool
	what map[string]int
}

func (c *counter) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		if r.Method != http.MethodGet {
			c.mu.Lock()
			if c.on {
				c.what[r.Method+" "+resource(r.URL.Path)]++
			}
			c.mu.Unlock()
		}
		return rt.RoundTrip(r)
	})
}

func (c *counter) start() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.on, c.what = true, make(map[string]int)
}

// stop stops counting and returns the total and the breakdown.
func (c *counter) stop() (int, map[string]int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.on = false
	n := 0
	for _, v := range c.what {
		n += v
	}
	return n, c.what
}

// resource is the kind of object a request path names: pods, events, nodes.
func resource(path string) string {
	parts := strings.Split(strings.Trim(path, "/"), "/")
	for _, p := range parts {
		if p == "pods" || p == "events" || p == "nodes" {
			return p
		}
	}
	return path
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func main() {
	size := flag.Int64("size", 1<<30, "model size in bytes")
	seconds := flag.Float64("seconds", 60, "about how long the download should take (the origin is throttled to size/seconds)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/kubewrites: ")
	if err := run(*size, *seconds); err != nil {
		log.Fatal(err)
	}
}

func run(size int64, seconds float64) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := kubetest.FindAssets(); err != nil {
		dir, derr := kubetest.AssetsDir()
		if derr != nil {
			return derr
		}
		log.Printf("building kube-apiserver and etcd into %s (about ten minutes the first time)", dir)
		if err := kubetest.BuildAssets(ctx, dir, os.Stderr); err != nil {
			return err
		}
	}
	work, err := os.MkdirTemp("", "weightd-bench-kubewrites-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	env, err := kubetest.Start(ctx, kubetest.Config{})
	if err != nil {
		return err
	}
	defer env.Close()
	const nodeName = "gpu-node-1"
	if _, err := env.CreateNode(ctx, nodeName, nil); err != nil {
		return err
	}

	// The origin: a generated model, throttled.
	modelDir := filepath.Join(work, "origin")
	if _, err := genmodel.Generate(modelDir, genmodel.Spec{Name: "bench/kube-writes", Files: 8, TotalBytes: size, Seed: 1}); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := genmodel.NewServer(ln, modelDir, genmodel.WithBandwidth(int64(float64(size)/seconds)))
	go func() {
		if err := srv.Run(ctx); err != nil {
			log.Printf("origin: %v", err)
		}
	}()
	r := srv.URL() + "/" + genmodel.ManifestName

	// The agent, with the defaults of `weightd agent`.
	writes := &counter{}
	cfg := rest.CopyConfig(env.Config)
	cfg.QPS, cfg.Burst = kube.DefaultQPS, kube.DefaultBurst
	cfg.Wrap(writes.wrap)
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	store, err := cache.Open(filepath.Join(work, "cache"))
	if err != nil {
		return err
	}
	defer store.Close()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)},
		prefetch.WithLogger(logger))
	intake, err := kube.NewPodIntake(client, nodeName, queue, kube.WithIntakeLogger(logger))
	if err != nil {
		return err
	}
	pub, err := kube.NewNodePublisher(client, nodeName, queue, store, kube.WithPublisherLogger(logger))
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{queue.Run, intake.Run, pub.Run} {
		wg.Go(func() { _ = run(ctx) })
	}
	defer wg.Wait()
	defer cancel()
	time.Sleep(2 * time.Second) // informers synced, the node's empty state written

	writes.start()
	start := time.Now()
	pods := env.Clientset().CoreV1().Pods("default")
	_, err = pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "llm", Annotations: map[string]string{podrequest.Models: r}},
		Spec:       corev1.PodSpec{NodeName: nodeName, Containers: []corev1.Container{{Name: "server", Image: "vllm/vllm-openai:v0.11.0"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	label := nodestate.Label(r)
	deadline := start.Add(time.Duration(seconds*float64(time.Second))*5 + 5*time.Minute)
	for {
		p, err := pods.Get(ctx, "llm", metav1.GetOptions{})
		if err != nil {
			return err
		}
		n, err := env.Clientset().CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		status := p.Annotations[podrequest.Status]
		if status == kube.StatusReady && n.Labels[label] == nodestate.LabelReady {
			break
		}
		if strings.HasPrefix(status, kube.StatusFailed) {
			return fmt.Errorf("the pod's model failed: %s", status)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %v: pod status %q", time.Since(start).Round(time.Second), status)
		}
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(time.Second) // the last Event
	took := time.Since(start)
	total, breakdown := writes.stop()

	keys := make([]string, 0, len(breakdown))
	for k := range breakdown {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		log.Printf("%-14s %d", k, breakdown[k])
	}
	log.Printf("%d writes in %.1f s for a %d-byte model (origin sent %d bytes)", total, took.Seconds(), size, srv.BytesServed())
	return json.NewEncoder(os.Stdout).Encode(result{
		Bench:        "kube-writes",
		WritesPerMin: float64(total) / took.Minutes(),
		Writes:       total,
		SizeBytes:    size,
		Seconds:      took.Seconds(),
	})
}
