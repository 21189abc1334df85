// Command policystatus measures what the status of one PrefetchPolicy costs
// the API server as the number of nodes it selects grows, in two designs:
//
//   - old: every agent writes its own entry of the policy's status.nodes
//     and watches every policy, so each write is delivered to every agent
//     (N² deliveries of an object that grows with N);
//   - new (pkg/policy today): every agent applies its own
//     PrefetchPolicyNode and watches only the policies; one agent, elected
//     with a Lease, watches the PrefetchPolicyNodes and writes the policy's
//     counts at most once per --interval.
//
// For each N of --nodes and each design of --design it starts a fresh etcd
// and kube-apiserver (internal/kubetest; built on the first run, about ten
// minutes, then cached), installs the CRDs (for the old design, the
// PrefetchPolicy CRD of before, crd-old.yaml), registers N Nodes and
// simulates N agents in this process. With --agent=controller (the
// default; new design only) each simulated agent is the real
// policy.Controller, with the default Config, and the real
// policy.Summarizer, with the default SummaryConfig but --interval, each
// with its own dynamic and typed clients (so its own informers: one watch
// on prefetchpolicies, one on its Node, and the leader's), a Fetcher whose
// jobs are ready at once (or after --fetch, so that the status is written
// twice, fetching then ready) and a Pinner that holds nothing. With
// --agent=watch each simulated agent is only a raw watch on
// prefetchpolicies whose bytes are counted and dropped (no decoding: the
// client's CPU is then not what limits the run) and the server-side apply
// of its node's status that the controller makes (same body, same field
// manager, tried again on failure), plus, in the new design, the real
// Summarizer; in the old design the counts are then not written.
//
// The clients share one transport (HTTP/2 connections) and have no
// client-side rate limit (QPS -1), so that client throttling is not what is
// measured. Each client is wrapped in a RoundTripper that counts, from the
// policy's creation on: the writes (applies and deletes of the policy's
// status and of PrefetchPolicyNodes), in the watch streams the events (one
// JSON line each, bookmarks not counted) and their bytes, the requests on
// the Lease, and the lists and watches the agents had to start again. The
// bench creates one policy selecting every node (one model, one image) and
// measures the time until every agent has been delivered a state of the
// policy that says all N nodes are ready (seconds: convergence, from the
// policy's creation): all N entries ready (old), readyNodes N (new). It
// then waits until nothing has been written or delivered for --settle, and
// prints one JSON line per N and design:
//
//	{"bench":"policy-status","nodes":N,"writes":…,"watch_events":…,"watch_bytes":…,
//	 "events_per_node":…,"seconds":…,"converged":true,"settled_s":…,"object_bytes":…,
//	 "relists":…,"rewatches":…,"agent":"watch","design":"new","node_writes":…,
//	 "count_writes":…,"node_watch_events":…,"lease_requests":…}
//
// object_bytes is the size of the policy as the API server sends it at the
// end (JSON, managed fields included). Everything runs on one machine:
// etcd, kube-apiserver and the N agents share its CPUs, so seconds are an
// upper bound of what a cluster sees; the counts are what matter.
//
//	go run ./bench/policystatus -agent watch -design old,new -nodes 50,100,200
//	go run ./bench/policystatus -nodes 50,100,200
//
// The old design at 200 nodes took about three minutes (raw agents) to ten
// (controllers) on a 2-core machine, and 500 would take hours (the bytes
// delivered grow as N³); docs/policy-status-scale.md has the figures.
package main

import (
	"bytes"
	"context"
	_ "embed" // the old CRD
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/record"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/policy"
	"github.com/weightd/weightd/pkg/prefetch"
)

type result struct {
	Bench         string  `json:"bench"`
	Nodes         int     `json:"nodes"`
	Writes        int64   `json:"writes"`
	WatchEvents   int64   `json:"watch_events"`
	WatchBytes    int64   `json:"watch_bytes"`
	EventsPerNode float64 `json:"events_per_node"`
	Seconds       float64 `json:"seconds"`
	Converged     bool    `json:"converged"`
	SettledS      float64 `json:"settled_s"`
	ObjectBytes   int     `json:"object_bytes"`
	Relists       int64   `json:"relists"`
	Rewatches     int64   `json:"rewatches"`
	Agent         string  `json:"agent"`
	Design        string  `json:"design"`
	// The new design's parts of the above: the writes of the
	// PrefetchPolicyNodes and of the counts, the events of the leader's
	// watch of the PrefetchPolicyNodes; and the requests on the Lease
	// (every agent campaigns).
	NodeWrites      int64 `json:"node_writes,omitempty"`
	CountWrites     int64 `json:"count_writes,omitempty"`
	NodeWatchEvents int64 `json:"node_watch_events,omitempty"`
	LeaseRequests   int64 `json:"lease_requests,omitempty"`
	Candidates      int   `json:"candidates,omitempty"` // agents campaigning for the Lease (0: all)
}

func main() {
	nodes := flag.String("nodes", "50,100", "comma-separated numbers of simulated agents (nodes), one run each")
	agent := flag.String("agent", "controller", "what a simulated agent is: controller (the real policy.Controller and policy.Summarizer) or watch (a raw watch and the apply of its node's status)")
	designs := flag.String("design", "new", "comma-separated designs, one run each per N: new (PrefetchPolicyNode objects, counted by an elected Summarizer) or old (entries in the policy's status; -agent watch only)")
	interval := flag.Duration("interval", policy.DefaultSummaryConfig().Interval, "the new design's Summarizer interval")
	candidates := flag.Int("candidates", 0, "the new design's agents that campaign for the Lease, as gossip bounds them in the agent (the first K here); 0 for all")
	fetch := flag.Duration("fetch", 0, "how long a simulated fetch takes; 0: ready at once (one entry write per node), more: fetching then ready (two)")
	settle := flag.Duration("settle", 5*time.Second, "quiet time (no write, no event) that ends a run after convergence")
	timeout := flag.Duration("timeout", 10*time.Minute, "how long one N may take")
	flag.Parse()
	log.SetFlags(log.Ltime)
	log.SetPrefix("bench/policystatus: ")
	if *agent != "controller" && *agent != "watch" {
		log.Fatalf("--agent %q: want controller or watch", *agent)
	}
	var ds []string
	for d := range strings.SplitSeq(*designs, ",") {
		switch {
		case d != "old" && d != "new":
			log.Fatalf("--design: %q, want old or new", d)
		case d == "old" && *agent == "controller":
			log.Fatal("--design old: the controller writes the new design only; -agent watch simulates the old")
		}
		ds = append(ds, d)
	}
	var ns []int
	for f := range strings.SplitSeq(*nodes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			log.Fatalf("--nodes: bad number %q", f)
		}
		ns = append(ns, n)
	}
	ctx := context.Background()
	if _, err := kubetest.FindAssets(); err != nil {
		dir, derr := kubetest.AssetsDir()
		if derr != nil {
			log.Fatal(derr)
		}
		log.Printf("building kube-apiserver and etcd into %s (about ten minutes the first time)", dir)
		if err := kubetest.BuildAssets(ctx, dir, os.Stderr); err != nil {
			log.Fatal(err)
		}
	}
	for _, n := range ns {
		for _, d := range ds {
			r, err := runOne(ctx, n, *agent, d == "new", *interval, *candidates, *fetch, *settle, *timeout)
			if err != nil {
				log.Fatalf("N=%d, design %s: %v", n, d, err)
			}
			if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
				log.Fatal(err)
			}
		}
	}
}

// The policy's name and content: one model and one image, selecting every
// node.
const policyName = "bench-all-nodes"

var (
	models = []string{"hf://meta-llama/Llama-3.1-8B-Instruct@main"}
	images = []string{"vllm/vllm-openai:v0.11.0"}
)

// mark is a resourceVersion delivered to an agent, and when.
type mark struct {
	rv uint64
	t  time.Time
}

// tap is one simulated agent's view of its traffic.
type tap struct {
	b       *bench
	mu      sync.Mutex
	marks   []mark
	pwatch  atomic.Int64 // watches on prefetchpolicies started
	plist   atomic.Int64 // lists of prefetchpolicies
	nwatch  atomic.Int64 // watches on nodes started
	lastRV  atomic.Uint64
	firstEv chan struct{} // closed at the first policy event (watch mode)
	evOnce  sync.Once
}

func (t *tap) mark(rv uint64) {
	t.mu.Lock()
	t.marks = append(t.marks, mark{rv, time.Now()})
	t.mu.Unlock()
	if rv > t.lastRV.Load() {
		t.lastRV.Store(rv)
	}
}

// reached returns when the agent was first delivered rv or later.
func (t *tap) reached(rv uint64) (time.Time, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, m := range t.marks {
		if m.rv >= rv {
			return m.t, true
		}
	}
	return time.Time{}, false
}

// bench holds the counters of one run.
type bench struct {
	on        atomic.Bool
	writes    atomic.Int64
	writeErrs atomic.Int64
	events    atomic.Int64
	bytes     atomic.Int64
	relists   atomic.Int64
	rewatches atomic.Int64
	// The new design's: see result.
	nodeWrites, countWrites, nodeEvents, leaseReqs atomic.Int64
	// failed counts the failed writes by HTTP status (0: no answer).
	failedMu sync.Mutex
	failed   map[int]int
	// When the first write was sent and the last one answered, in ns
	// since the Unix epoch.
	firstWrite, lastWrite atomic.Int64
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// wrap counts t's requests on prefetchpolicies, prefetchpolicynodes and
// Leases, and taps its watch streams.
func (t *tap) wrap(rt http.RoundTripper) http.RoundTripper {
	b := t.b
	return roundTripFunc(func(r *http.Request) (*http.Response, error) {
		path := r.URL.Path
		nodes := strings.Contains(path, "/"+policy.NodeResource)
		switch {
		case strings.Contains(path, "/leases"):
			if b.on.Load() {
				b.leaseReqs.Add(1)
			}
			return rt.RoundTrip(r)
		case !nodes && !strings.Contains(path, "/"+policy.Resource):
			if strings.HasSuffix(path, "/nodes") && isWatch(r) {
				t.nwatch.Add(1)
			}
			return rt.RoundTrip(r)
		}
		write := r.Method == http.MethodPatch || r.Method == http.MethodDelete
		if write && b.on.Load() {
			b.firstWrite.CompareAndSwap(0, time.Now().UnixNano())
		}
		resp, err := rt.RoundTrip(r)
		switch {
		case write:
			if b.on.Load() {
				b.writes.Add(1)
				switch {
				case nodes:
					b.nodeWrites.Add(1)
				case r.URL.Query().Get("fieldManager") == policy.SummaryFieldManager:
					b.countWrites.Add(1)
				}
				b.lastWrite.Store(time.Now().UnixNano())
				if err != nil || resp.StatusCode >= 300 {
					b.writeErrs.Add(1)
					code := 0
					if err == nil {
						code = resp.StatusCode
					}
					b.failedMu.Lock()
					if b.failed == nil {
						b.failed = make(map[int]int)
					}
					b.failed[code]++
					b.failedMu.Unlock()
				}
			}
		case r.Method == http.MethodGet && isWatch(r) && nodes:
			// The leader's watch: counted, but its resourceVersions
			// are not the policy's.
			if err == nil && resp.StatusCode == http.StatusOK {
				resp.Body = &scanBody{ReadCloser: resp.Body, s: &stream{t: t, watch: true, nodes: true}}
			}
		case r.Method == http.MethodGet && isWatch(r):
			if t.pwatch.Add(1) > 1 && b.on.Load() {
				b.rewatches.Add(1)
			}
			if err == nil && resp.StatusCode == http.StatusOK {
				resp.Body = &scanBody{ReadCloser: resp.Body, s: &stream{t: t, watch: true}}
			}
		case r.Method == http.MethodGet && strings.HasSuffix(path, "/"+policy.Resource):
			if t.plist.Add(1) > 1 && b.on.Load() {
				b.relists.Add(1)
			}
			if err == nil && resp.StatusCode == http.StatusOK {
				resp.Body = &scanBody{ReadCloser: resp.Body, s: &stream{t: t}}
			}
		}
		return resp, err
	})
}

func isWatch(r *http.Request) bool {
	w := r.URL.Query().Get("watch")
	return w == "true" || w == "1"
}

// scanBody feeds what is read of a response to a stream.
type scanBody struct {
	io.ReadCloser
	s *stream
}

func (b *scanBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.s.feed(p[:n])
	return n, err
}

func (b *scanBody) Close() error {
	b.s.flush()
	return b.ReadCloser.Close()
}

var rvKey = []byte(`"resourceVersion":"`)

// stream scans a response: a watch stream is one JSON event a line; a list
// is one document. Of each it finds the first resourceVersion (a watch
// event's object's; a list's first item's, or the list's own) without
// decoding the rest, and counts the events and their bytes.
type stream struct {
	t     *tap
	watch bool
	nodes bool   // a watch of PrefetchPolicyNodes: counted, not marked
	buf   []byte // the line so far, until its resourceVersion is found
	from  int    // where in buf to search next
	found bool
	rv    uint64
	typ   string
	size  int64
}

func (s *stream) feed(p []byte) {
	for len(p) > 0 {
		seg, rest, nl := p, []byte(nil), false
		if s.watch {
			if i := bytes.IndexByte(p, '\n'); i >= 0 {
				seg, rest, nl = p[:i], p[i+1:], true
			}
		}
		s.size += int64(len(seg))
		if !s.found {
			s.buf = append(s.buf, seg...)
			s.look()
		}
		if !nl {
			return
		}
		s.size++ // the newline
		s.flush()
		p = rest
	}
}

func (s *stream) look() {
	i := bytes.Index(s.buf[s.from:], rvKey)
	if i < 0 {
		s.from = max(0, len(s.buf)-len(rvKey)+1)
		return
	}
	at := s.from + i
	start := at + len(rvKey)
	j := bytes.IndexByte(s.buf[start:], '"')
	if j < 0 {
		s.from = at // the digits are not all here yet
		return
	}
	s.rv, _ = strconv.ParseUint(string(s.buf[start:start+j]), 10, 64)
	s.typ = eventType(s.buf)
	s.found = true
	s.buf = s.buf[:0]
}

// eventType is the type of the watch event that line begins.
func eventType(line []byte) string {
	const k = `"type":"`
	head := line[:min(len(line), 64)]
	i := bytes.Index(head, []byte(k))
	if i < 0 {
		return ""
	}
	rest := head[i+len(k):]
	j := bytes.IndexByte(rest, '"')
	if j < 0 {
		return ""
	}
	return string(rest[:j])
}

// flush ends the current line (or document).
func (s *stream) flush() {
	if s.size == 0 {
		return
	}
	typ := s.typ
	if !s.found {
		typ = eventType(s.buf)
	}
	if s.found && !s.nodes {
		s.t.mark(s.rv)
	}
	if s.watch && typ != "BOOKMARK" && typ != "" {
		if s.t.b.on.Load() {
			s.t.b.events.Add(1)
			s.t.b.bytes.Add(s.size)
			if s.nodes {
				s.t.b.nodeEvents.Add(1)
			}
		}
		if s.t.firstEv != nil && !s.nodes {
			s.t.evOnce.Do(func() { close(s.t.firstEv) })
		}
	}
	s.buf, s.from, s.found, s.rv, s.typ, s.size = s.buf[:0], 0, false, 0, "", 0
}

// readyJob is a fetch that is ready at once, or after a while.
type readyJob struct {
	mu   sync.Mutex
	st   prefetch.JobStatus
	done chan struct{}
}

func (j *readyJob) Done() <-chan struct{}       { return j.done }
func (j *readyJob) Blobs() []content.Descriptor { return nil }
func (j *readyJob) Status() prefetch.JobStatus {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.st
}

func (j *readyJob) finish() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.st.State, j.st.BytesDone, j.st.Finished = prefetch.StateReady, j.st.BytesTotal, time.Now()
	close(j.done)
}

// fetcher hands out readyJobs.
type fetcher struct{ after time.Duration }

func (f fetcher) Submit(ref string, _ prefetch.Priority) (policy.Job, error) {
	now := time.Now()
	j := &readyJob{done: make(chan struct{}), st: prefetch.JobStatus{
		Ref: ref, State: prefetch.StateFetching, Priority: prefetch.PriorityBackground,
		BytesTotal: 16 << 30, Created: now, Started: now,
	}}
	if f.after <= 0 {
		j.finish()
	} else {
		time.AfterFunc(f.after, j.finish)
	}
	return j, nil
}

// noPins is a Pinner that holds nothing (the jobs list no blobs).
type noPins struct{}

func (noPins) Pin(digest.Digest, string) error   { return nil }
func (noPins) Unpin(digest.Digest, string) error { return nil }
func (noPins) List() []cache.Info                { return nil }

// runOne measures N agents against a fresh API server.
func runOne(parent context.Context, n int, mode string, newDesign bool, interval time.Duration, candidates int, fetch, settle, timeout time.Duration) (*result, error) {
	ctx, cancel := context.WithTimeout(parent, timeout+3*time.Minute)
	defer cancel()
	env, err := kubetest.Start(ctx, kubetest.Config{})
	if err != nil {
		return nil, err
	}
	defer env.Close()
	admin := rest.CopyConfig(env.Config)
	admin.QPS = -1
	adminDyn, err := dynamic.NewForConfig(admin)
	if err != nil {
		return nil, err
	}
	if err := policy.InstallCRD(ctx, adminDyn); err != nil {
		return nil, err
	}
	if !newDesign {
		if err := installOldCRD(ctx, adminDyn); err != nil {
			return nil, err
		}
	}
	summary := policy.DefaultSummaryConfig()
	summary.Interval = interval
	if err := env.EnsureNamespace(ctx, summary.LeaseNamespace); err != nil {
		return nil, err
	}
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("node-%04d", i)
	}
	// The controller watches its Node; the Summarizer counts the objects
	// of existing Nodes only.
	if mode == "controller" || newDesign {
		if err := createNodes(ctx, env, names); err != nil {
			return nil, err
		}
	}

	// The agents.
	b := &bench{}
	taps := make([]*tap, n)
	agents, stopAgents := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stopAgents()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	summary.Logger = logger
	created := &createdPolicy{done: make(chan struct{})}
	for i, node := range names {
		t := &tap{b: b}
		taps[i] = t
		cfg := rest.CopyConfig(env.Config)
		cfg.QPS = -1
		cfg.Wrap(t.wrap)
		dyn, err := dynamic.NewForConfig(cfg)
		if err != nil {
			return nil, err
		}
		switch mode {
		case "controller":
			kc, err := kubernetes.NewForConfig(cfg)
			if err != nil {
				return nil, err
			}
			c, err := policy.New(node, kc, dyn, fetcher{fetch}, noPins{}, policy.Config{
				Recorder: &record.FakeRecorder{}, Logger: logger,
			})
			if err != nil {
				return nil, err
			}
			wg.Go(func() {
				if err := c.Run(agents); err != nil {
					log.Printf("agent %s: %v", node, err)
				}
			})
		case "watch":
			t.firstEv = make(chan struct{})
			hc, err := rest.HTTPClientFor(cfg)
			if err != nil {
				return nil, err
			}
			var p *createdPolicy // nil: the old design
			if newDesign {
				p = created
			}
			wg.Go(func() { rawAgent(agents, env.Host, hc, dyn, node, t, fetch, p) })
		}
		if newDesign {
			// The agent's Summarizer, with a tap of its own: the
			// leader's watches are counted, not taken for the agent's.
			sc := rest.CopyConfig(env.Config)
			sc.QPS = -1
			sc.Wrap((&tap{b: b}).wrap)
			skc, err := kubernetes.NewForConfig(sc)
			if err != nil {
				return nil, err
			}
			sdyn, err := dynamic.NewForConfig(sc)
			if err != nil {
				return nil, err
			}
			smeta, err := metadata.NewForConfig(sc)
			if err != nil {
				return nil, err
			}
			scfg := summary
			if candidates > 0 {
				candidate := i < candidates
				scfg.Candidate = func() bool { return candidate }
			}
			s, err := policy.NewSummarizer(node, skc, sdyn, smeta, scfg)
			if err != nil {
				return nil, err
			}
			wg.Go(func() {
				if err := s.Run(agents); err != nil {
					log.Printf("summarizer %s: %v", node, err)
				}
			})
		}
	}
	// Every agent listed and watches (and watches its Node).
	if err := waitFor(ctx, 5*time.Minute, func() bool {
		for _, t := range taps {
			if t.pwatch.Load() == 0 || (mode == "controller" && t.nwatch.Load() == 0) {
				return false
			}
		}
		return true
	}); err != nil {
		return nil, fmt.Errorf("agents not watching: %w", err)
	}
	time.Sleep(time.Second)
	log.Printf("N=%d: %d agents (%s) watching", n, n, mode)

	// The observer: a watch of its own (not counted), to learn the first
	// resourceVersion at which all N entries are ready.
	list, err := adminDyn.Resource(policy.GVR).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	obs := &observer{n: n, counts: newDesign, allReady: make(chan struct{})}
	go obs.run(ctx, adminDyn, list.GetResourceVersion())

	b.on.Store(true)
	t0 := time.Now()
	p := &policy.PrefetchPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: policyName},
		Spec:       policy.Spec{NodeSelector: &metav1.LabelSelector{}, Models: models, Images: images},
	}
	u, err := policy.ToUnstructured(p)
	if err != nil {
		return nil, err
	}
	u, err = adminDyn.Resource(policy.GVR).Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		return nil, err
	}
	if created.p, err = policy.FromUnstructured(u); err != nil {
		return nil, err
	}
	close(created.done)
	deadline := t0.Add(timeout)
	design := "old"
	if newDesign {
		design = "new"
	}
	res := &result{Bench: "policy-status", Nodes: n, Agent: mode, Design: design}
	progress := time.NewTicker(10 * time.Second)
	defer progress.Stop()
	// Convergence: every agent has been delivered the all-ready state.
	var conv time.Time
	for conv.IsZero() && time.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-progress.C:
			log.Printf("N=%d: %.0fs: %d writes, %d events, %d MB delivered, %d/%d entries ready",
				n, time.Since(t0).Seconds(), b.writes.Load(), b.events.Load(), b.bytes.Load()>>20, obs.ready.Load(), n)
		case <-time.After(50 * time.Millisecond):
		}
		target := obs.target.Load()
		if target == 0 {
			continue
		}
		last := t0
		for _, t := range taps {
			at, ok := t.reached(target)
			if !ok {
				last = time.Time{}
				break
			}
			if at.After(last) {
				last = at
			}
		}
		conv = last
	}
	res.Converged = !conv.IsZero()
	if res.Converged {
		res.Seconds = conv.Sub(t0).Seconds()
		log.Printf("N=%d: converged after %.1fs", n, res.Seconds)
	} else {
		res.Seconds = time.Since(t0).Seconds()
		log.Printf("N=%d: not converged after %.0fs", n, res.Seconds)
	}
	// Settle: nothing written or delivered for settle.
	quietSince, last := time.Now(), [2]int64{b.writes.Load(), b.events.Load()}
	for res.Converged && time.Since(quietSince) < settle && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		if now := [2]int64{b.writes.Load(), b.events.Load()}; now != last {
			quietSince, last = time.Now(), now
		}
	}
	b.on.Store(false)
	res.SettledS = quietSince.Sub(t0).Seconds()
	res.Writes, res.WatchEvents, res.WatchBytes = b.writes.Load(), b.events.Load(), b.bytes.Load()
	res.EventsPerNode = float64(res.WatchEvents) / float64(n)
	res.Relists, res.Rewatches = b.relists.Load(), b.rewatches.Load()
	res.NodeWrites, res.CountWrites = b.nodeWrites.Load(), b.countWrites.Load()
	res.NodeWatchEvents, res.LeaseRequests, res.Candidates = b.nodeEvents.Load(), b.leaseReqs.Load(), candidates
	if f := b.firstWrite.Load(); f > 0 {
		log.Printf("N=%d: writes sent from %.1fs, the last answered %.1fs after the policy's creation", n,
			time.Unix(0, f).Sub(t0).Seconds(), time.Unix(0, b.lastWrite.Load()).Sub(t0).Seconds())
	}
	if e := b.writeErrs.Load(); e > 0 {
		b.failedMu.Lock()
		log.Printf("N=%d: %d writes failed (by HTTP status, 0: no answer): %v", n, e, b.failed)
		b.failedMu.Unlock()
	}
	// The object as sent, managed fields included.
	raw, err := env.Clientset().RESTClient().Get().AbsPath("/apis", policy.Group, policy.Version, policy.Resource, policyName).DoRaw(ctx)
	if err != nil {
		return nil, err
	}
	res.ObjectBytes = len(raw)
	if got, err := adminDyn.Resource(policy.GVR).Get(ctx, policyName, metav1.GetOptions{}); err == nil {
		if p, err := policy.FromUnstructured(got); err == nil {
			log.Printf("N=%d: status: nodeCount %d, readyNodes %d", n, p.Status.NodeCount, p.Status.ReadyNodes)
		}
	}
	stopAgents()
	return res, nil
}

// oldCRD is PrefetchPolicy's CRD with entries in status.nodes.
//
//go:embed crd-old.yaml
var oldCRD []byte

// installOldCRD replaces PrefetchPolicy's CRD with oldCRD and waits until
// the API server keeps an entry of status.nodes.
func installOldCRD(ctx context.Context, dyn dynamic.Interface) error {
	js, err := utilyaml.ToJSON(oldCRD)
	if err != nil {
		return err
	}
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(js); err != nil {
		return err
	}
	crds := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	if _, err := dyn.Resource(crds).Apply(ctx, u.GetName(), u, metav1.ApplyOptions{FieldManager: "bench", Force: true}); err != nil {
		return fmt.Errorf("applying the old CRD: %w", err)
	}
	// A probe policy: its entry survives once the new schema serves.
	probe := &policy.PrefetchPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "probe"},
		Spec:       policy.Spec{NodeSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"none": "none"}}, Models: models},
	}
	pu, err := policy.ToUnstructured(probe)
	if err != nil {
		return err
	}
	if _, err := dyn.Resource(policy.GVR).Create(ctx, pu, metav1.CreateOptions{}); err != nil {
		return err
	}
	defer func() {
		_ = dyn.Resource(policy.GVR).Delete(context.WithoutCancel(ctx), "probe", metav1.DeleteOptions{})
	}()
	return waitFor(ctx, time.Minute, func() bool {
		if err := applyEntryTo(ctx, dyn, "probe", "probe-node", prefetch.StateReady, nil); err != nil {
			return false
		}
		got, err := dyn.Resource(policy.GVR).Get(ctx, "probe", metav1.GetOptions{})
		return err == nil && readyEntries(got, got.GetGeneration()) == 1
	})
}

// readyEntries counts the entries of the old design's status.nodes ready at
// generation gen.
func readyEntries(u *unstructured.Unstructured, gen int64) int {
	nodes, _, _ := unstructured.NestedSlice(u.Object, "status", "nodes")
	ready := 0
	for _, n := range nodes {
		m, ok := n.(map[string]any)
		if ok && m["state"] == string(policy.NodeReady) && m["observedGeneration"] == gen {
			ready++
		}
	}
	return ready
}

// createNodes registers the Nodes, a few at a time.
func createNodes(ctx context.Context, env *kubetest.Env, names []string) error {
	ch := make(chan string)
	errs := make(chan error, len(names))
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for name := range ch {
				_, err := env.CreateNode(ctx, name, nil)
				errs <- err
			}
		})
	}
	for _, name := range names {
		ch <- name
	}
	close(ch)
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// waitFor polls cond until it holds, ctx ends or d has passed.
func waitFor(ctx context.Context, d time.Duration, cond func() bool) error {
	end := time.Now().Add(d)
	for !cond() {
		if time.Now().After(end) {
			return fmt.Errorf("not after %v", d)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// observer watches the policy and records the first resourceVersion at
// which it says that its n nodes are ready at its generation: n entries
// ready (the old design) or readyNodes n (counts, the new).
type observer struct {
	n        int
	counts   bool
	target   atomic.Uint64
	ready    atomic.Int64
	allReady chan struct{}
}

func (o *observer) run(ctx context.Context, dyn dynamic.Interface, rv string) {
	for ctx.Err() == nil && o.target.Load() == 0 {
		w, err := dyn.Resource(policy.GVR).Watch(ctx, metav1.ListOptions{ResourceVersion: rv})
		if err != nil {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		for ev := range w.ResultChan() {
			if ev.Type == watch.Error {
				rv = "" // too old: start again from the current state
				break
			}
			u, ok := ev.Object.(*unstructured.Unstructured)
			if !ok || u.GetName() != policyName {
				continue
			}
			rv = u.GetResourceVersion()
			if o.check(u) {
				w.Stop()
				return
			}
		}
		w.Stop()
	}
}

func (o *observer) check(u *unstructured.Unstructured) bool {
	p, err := policy.FromUnstructured(u)
	if err != nil {
		return false
	}
	ready := int(p.Status.ReadyNodes)
	if !o.counts {
		ready = readyEntries(u, p.Generation)
	}
	o.ready.Store(int64(ready))
	if ready < o.n {
		return false
	}
	rv, err := strconv.ParseUint(u.GetResourceVersion(), 10, 64)
	if err != nil {
		return false
	}
	o.target.Store(rv)
	close(o.allReady)
	return true
}

// createdPolicy is the bench's policy, once created (done closed).
type createdPolicy struct {
	done chan struct{}
	p    *policy.PrefetchPolicy
}

// rawAgent is an agent reduced to its API traffic on the policy: a watch
// whose events are counted and dropped, and the apply of its node's status
// (ready, or fetching then ready after fetch, at least the controller's
// debounce apart) once the policy has been delivered to it, each tried
// again until it is written: an entry of the policy's status (the old
// design, created nil) or its PrefetchPolicyNode.
func rawAgent(ctx context.Context, host string, hc *http.Client, dyn dynamic.Interface, node string, t *tap, fetch time.Duration, created *createdPolicy) {
	go func() {
		select {
		case <-ctx.Done():
			return
		case <-t.firstEv:
		}
		var p *policy.PrefetchPolicy
		if created != nil {
			<-created.done
			p = created.p
		}
		if fetch > 0 {
			applyRetrying(ctx, dyn, node, prefetch.StateFetching, p)
			select {
			case <-ctx.Done():
				return
			case <-time.After(max(fetch, policy.DefaultConfig().Debounce)):
			}
		}
		applyRetrying(ctx, dyn, node, prefetch.StateReady, p)
	}()
	// The informer's list, then its watch, again from the last
	// resourceVersion seen whenever it ends.
	base := host + "/apis/" + policy.Group + "/" + policy.Version + "/" + policy.Resource
	rv := ""
	for ctx.Err() == nil {
		url := base
		if rv == "" {
			url += "?limit=500"
		} else {
			url += "?watch=true&allowWatchBookmarks=true&timeoutSeconds=600&resourceVersion=" + rv
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return
		}
		req.Header.Set("Accept", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusGone {
			rv = ""
			continue
		}
		if last := t.lastRV.Load(); last > 0 {
			rv = strconv.FormatUint(last, 10)
		} else if rv == "" {
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// applyRetrying applies node's status until it is written or ctx ends,
// pausing between tries as the controller's queue does (from 100ms,
// doubling, at most 30s).
func applyRetrying(ctx context.Context, dyn dynamic.Interface, node string, st prefetch.JobState, p *policy.PrefetchPolicy) {
	pause := 100 * time.Millisecond
	for {
		err := applyEntry(ctx, dyn, node, st, p)
		if err == nil || ctx.Err() != nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, 30*time.Second)
	}
}

// applyEntry applies node's status, built by policy.BuildEntry under the
// node's field manager: as the controller does, to p's PrefetchPolicyNode
// (policy.NodeStatusObject), or, p nil, as the old design did, as an entry
// of the policy's status.nodes.
func applyEntry(ctx context.Context, dyn dynamic.Interface, node string, st prefetch.JobState, p *policy.PrefetchPolicy) error {
	return applyEntryTo(ctx, dyn, policyName, node, st, p)
}

// applyEntryTo is applyEntry for the policy named name.
func applyEntryTo(ctx context.Context, dyn dynamic.Interface, name, node string, st prefetch.JobState, p *policy.PrefetchPolicy) error {
	var states []policy.RefState
	for _, w := range policy.Wants(policy.Spec{Models: models, Images: images}) {
		states = append(states, policy.RefState{Shown: w.Shown, State: st, Bytes: 16 << 30})
	}
	e := policy.BuildEntry(node, 1, states, time.Now())
	opts := metav1.ApplyOptions{FieldManager: policy.FieldManager(node), Force: true}
	if p != nil {
		obj, err := policy.NodeStatusObject(p, e)
		if err != nil {
			return err
		}
		_, err = dyn.Resource(policy.NodeGVR).Apply(ctx, obj.GetName(), obj, opts)
		return err
	}
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&e)
	if err != nil {
		return err
	}
	// The old entries had no counts of their own.
	delete(m, "readyCount")
	delete(m, "failedCount")
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": policy.APIVersion, "kind": policy.Kind,
		"metadata": map[string]any{"name": name},
		"status":   map[string]any{"nodes": []any{m}},
	}}
	_, err = dyn.Resource(policy.GVR).ApplyStatus(ctx, name, obj, opts)
	return err
}
