// Command extender measures the latency of weightd's scheduler extender as
// kube-scheduler sees it: 1,000 nodes, each with a realistic cache summary
// (about 20 models of a catalog of 60, from 1 to 150 GB; most ready, some
// part-way, a few failed) and a ready label per model held complete; then
// -requests prioritize calls in nodenames mode (nodeCacheCapable: true, all
// 1,000 names) for a pod asking for 3 models, each a real ExtenderArgs JSON
// POSTed over a keep-alive HTTP connection to the extender's handler, timed
// from the request's first byte to the decoded HostPriorityList.
//
// Node state reaches the extender the way it does in a cluster when the
// kube-apiserver and etcd binaries are built (internal/kubetest, `make
// kube-assets`): the nodes are created in a real API server and the
// extender's node informer lists them. Without the binaries the same nodes
// are fed to the extender's cache directly, and the output says so
// ("node_state":"direct" instead of "informer").
//
// The last line is one JSON object:
//
//	{"bench":"extender","nodes":1000,"p50_ms":…,"p99_ms":…,…}
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/extender"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

type result struct {
	Bench         string  `json:"bench"`
	Nodes         int     `json:"nodes"`
	P50ms         float64 `json:"p50_ms"`
	P99ms         float64 `json:"p99_ms"`
	MaxMs         float64 `json:"max_ms"`
	Requests      int     `json:"requests"`
	RequestBytes  int     `json:"request_bytes"`
	NodeState     string  `json:"node_state"`
	ModelsPerNode int     `json:"models_per_node"`
	PodModels     int     `json:"pod_models"`
	FilterP50ms   float64 `json:"filter_p50_ms"`
}

func main() {
	nodes := flag.Int("nodes", 1000, "nodes in the cluster")
	perNode := flag.Int("models-per-node", 20, "models in each node's summary")
	catalog := flag.Int("catalog", 60, "distinct models in the cluster")
	podModels := flag.Int("pod-models", 3, "models the scheduled pod asks for")
	requests := flag.Int("requests", 500, "prioritize calls timed")
	direct := flag.Bool("direct", false, "feed the cache directly even when the API server binaries are built")
	flag.Parse()
	if *perNode > *catalog || *podModels > *catalog || *nodes < 1 || *requests < 1 {
		log.Fatal("extender bench: need nodes, requests >= 1 and models-per-node, pod-models <= catalog")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	if err := run(ctx, *nodes, *perNode, *catalog, *podModels, *requests, *direct); err != nil {
		log.Fatalf("extender bench: %v", err)
	}
}

func run(ctx context.Context, nNodes, perNode, nCatalog, podModels, requests int, direct bool) error {
	rng := rand.New(rand.NewPCG(1, 2))
	models := make([]model, nCatalog)
	for i := range models {
		models[i] = model{ref: fmt.Sprintf("hf://bench-org/model-%02d@main", i), size: (1 + rng.Int64N(150)) * 1e9}
	}
	nodes := make([]*corev1.Node, nNodes)
	for i := range nodes {
		n, err := mkNode(rng, fmt.Sprintf("gpu-%04d", i), models, perNode)
		if err != nil {
			return err
		}
		nodes[i] = n
	}

	c := extender.NewCache()
	state := "direct"
	if _, err := kubetest.FindAssets(); err != nil || direct {
		if err != nil {
			fmt.Fprintf(os.Stderr, "extender bench: %v\nextender bench: feeding the extender's cache directly, not through a real API server and informer\n", err)
		}
		for _, n := range nodes {
			if err := c.Set(n); err != nil {
				return err
			}
		}
	} else {
		stop, err := throughAPIServer(ctx, nodes, c)
		if err != nil {
			return err
		}
		defer stop()
		state = "informer"
	}
	if c.Len() != nNodes {
		return fmt.Errorf("the cache holds %d nodes, want %d", c.Len(), nNodes)
	}

	h, err := extender.NewHandler(c)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }() // ends with ErrServerClosed at Close
	defer srv.Close()
	base := "http://" + ln.Addr().String()

	// The pod asks for the 3 models the most nodes hold part of, so the
	// scores spread over the whole range.
	var names []string
	for _, n := range nodes {
		names = append(names, n.Name)
	}
	want := models[:podModels]
	refs := ""
	for i, m := range want {
		if i > 0 {
			refs += ", "
		}
		refs += m.ref
	}
	pod := &corev1.Pod{
		TypeMeta:   metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "llm-7d9f8", Namespace: "serving", UID: "3f1c7e0a-0000-4000-8000-000000000001", Annotations: map[string]string{podrequest.Models: refs}, Labels: map[string]string{"app": "llm"}},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{Name: "server", Image: "vllm/vllm-openai:v0.11.0", Args: []string{"--model", "/models/llm"}}},
		},
	}
	body, err := json.Marshal(extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names})
	if err != nil {
		return err
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	call := func(verb string, out any) (time.Duration, error) {
		start := time.Now()
		resp, err := client.Post(base+"/"+verb, "application/json", bytes.NewReader(body))
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b, _ := io.ReadAll(resp.Body)
			return 0, fmt.Errorf("%s: %s: %s", verb, resp.Status, b)
		}
		if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
			return 0, err
		}
		return time.Since(start), nil
	}

	var list extenderv1.HostPriorityList
	for range 20 { // warm up connections and caches
		if _, err := call(extender.VerbPrioritize, &list); err != nil {
			return err
		}
	}
	if err := check(list, nodes, want); err != nil {
		return err
	}
	lat := make([]time.Duration, requests)
	for i := range lat {
		if lat[i], err = call(extender.VerbPrioritize, &list); err != nil {
			return err
		}
	}
	// Filter for the same pod (not requiring warm nodes: passes all).
	flat := make([]time.Duration, min(requests, 100))
	for i := range flat {
		var res extenderv1.ExtenderFilterResult
		if flat[i], err = call(extender.VerbFilter, &res); err != nil {
			return err
		}
	}
	slices.Sort(lat)
	slices.Sort(flat)
	hist := map[int64]int{}
	for _, hp := range list {
		hist[hp.Score]++
	}
	fmt.Fprintf(os.Stderr, "extender bench: %d nodes (%s), %d models each of %d, pod asks for %d; scores: %v\n", nNodes, state, perNode, nCatalog, podModels, hist)
	out, _ := json.Marshal(result{
		Bench: "extender", Nodes: nNodes,
		P50ms: ms(pct(lat, 0.50)), P99ms: ms(pct(lat, 0.99)), MaxMs: ms(lat[len(lat)-1]),
		Requests: requests, RequestBytes: len(body), NodeState: state,
		ModelsPerNode: perNode, PodModels: podModels, FilterP50ms: ms(pct(flat, 0.50)),
	})
	fmt.Println(string(out))
	return nil
}

type model struct {
	ref  string
	size int64
}

// mkNode is a node as its agent leaves it: perNode models of the catalog
// in its summary (two in three ready, one in four part-way, the rest
// failed), a ready label for each one held complete, and the usual
// labels of a GPU node.
func mkNode(rng *rand.Rand, name string, catalog []model, perNode int) (*corev1.Node, error) {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
		corev1.LabelHostname: name, corev1.LabelOSStable: "linux", corev1.LabelArchStable: "amd64",
		"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
	}}}
	var sum nodestate.Summary
	for _, i := range rng.Perm(len(catalog))[:perNode] {
		m := catalog[i]
		e := nodestate.Entry{Key: nodestate.Key(m.ref), Ref: m.ref, Total: m.size}
		switch p := rng.IntN(12); {
		case p < 8:
			e.State, e.Bytes = nodestate.StateReady, m.size
			n.Labels[nodestate.Label(m.ref)] = nodestate.LabelReady
		case p < 11:
			e.State, e.Bytes = nodestate.StateFetching, rng.Int64N(m.size)
		default:
			e.State, e.Bytes = nodestate.StateFailed, 0
		}
		sum.Entries = append(sum.Entries, e)
	}
	s, err := sum.Encode()
	if err != nil {
		return nil, err
	}
	n.Annotations = map[string]string{nodestate.SummaryAnnotation: s}
	return n, nil
}

// throughAPIServer starts a real API server, creates the nodes in it and
// feeds c through the extender's informer, returning once it has synced.
func throughAPIServer(ctx context.Context, nodes []*corev1.Node, c *extender.Cache) (stop func(), err error) {
	start := time.Now()
	env, err := kubetest.Start(ctx, kubetest.Config{})
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			env.Close()
		}
	}()
	rc := *env.Config
	rc.QPS, rc.Burst = 500, 500
	client, err := kubernetes.NewForConfig(&rc)
	if err != nil {
		return nil, err
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	for _, n := range nodes {
		g.Go(func() error {
			_, err := client.CoreV1().Nodes().Create(gctx, n, metav1.CreateOptions{})
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return nil, fmt.Errorf("creating nodes: %w", err)
	}
	created := time.Since(start)
	wctx, cancel := context.WithCancel(ctx)
	w := extender.NewWatcher(client, c)
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := w.Run(wctx); err != nil && !errors.Is(err, context.Canceled) {
			log.Printf("extender bench: watcher: %v", err)
		}
	})
	stop = func() {
		cancel()
		wg.Wait()
		env.Close()
	}
	if err := w.WaitSynced(ctx); err != nil {
		stop()
		return nil, err
	}
	fmt.Fprintf(os.Stderr, "extender bench: real API server up and %d nodes created in %.1f s; informer synced %.1f s later\n",
		len(nodes), created.Seconds(), (time.Since(start) - created).Seconds())
	return stop, nil
}

// check verifies the answer against the nodes: every node scored, a node
// holding all the pod's models ready scores 10, one holding none scores 0.
func check(list extenderv1.HostPriorityList, nodes []*corev1.Node, want []model) error {
	if len(list) != len(nodes) {
		return fmt.Errorf("%d scores for %d nodes", len(list), len(nodes))
	}
	for i, n := range nodes {
		ready := 0
		for _, m := range want {
			if n.Labels[nodestate.Label(m.ref)] == nodestate.LabelReady {
				ready++
			}
		}
		got := list[i]
		if got.Host != n.Name {
			return fmt.Errorf("score %d is for %q, want %q", i, got.Host, n.Name)
		}
		if ready == len(want) && got.Score != extenderv1.MaxExtenderPriority {
			return fmt.Errorf("node %s holds every model but scores %d", n.Name, got.Score)
		}
		if got.Score > 0 && !partly(n, want) {
			return fmt.Errorf("node %s holds none of the models but scores %d", n.Name, got.Score)
		}
	}
	return nil
}

// partly reports whether n's summary lists any of the models with bytes.
func partly(n *corev1.Node, want []model) bool {
	sum, err := nodestate.Decode(n.Annotations[nodestate.SummaryAnnotation])
	if err != nil {
		return false
	}
	for _, m := range want {
		if e, ok := sum.Find(nodestate.Key(m.ref)); ok && e.Bytes > 0 {
			return true
		}
	}
	return false
}

func pct(d []time.Duration, p float64) time.Duration {
	return d[min(len(d)-1, int(p*float64(len(d))))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
