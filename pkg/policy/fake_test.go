package policy_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/policy"
	"github.com/weightd/weightd/pkg/prefetch"
)

// fakeJob is a job the test finishes by hand.
type fakeJob struct {
	mu    sync.Mutex
	st    prefetch.JobStatus
	blobs []content.Descriptor
	done  chan struct{}
}

func (j *fakeJob) Done() <-chan struct{} { return j.done }

func (j *fakeJob) Status() prefetch.JobStatus {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.st
}

func (j *fakeJob) Blobs() []content.Descriptor {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.blobs)
}

func (j *fakeJob) finish(blobs []digest.Digest, err string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.st.Finished = time.Now()
	if err != "" {
		j.st.State, j.st.Error = prefetch.StateFailed, err
	} else {
		j.st.State = prefetch.StateReady
		for _, d := range blobs {
			j.blobs = append(j.blobs, content.Descriptor{Digest: d, Size: 10})
			j.st.BytesDone += 10
		}
	}
	close(j.done)
}

// fakeFetcher hands out fakeJobs, one unfinished job per reference.
type fakeFetcher struct {
	mu   sync.Mutex
	jobs map[string][]*fakeJob // ref → every job submitted for it
}

func (f *fakeFetcher) Submit(ref string, p prefetch.Priority) (policy.Job, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p != prefetch.PriorityBackground {
		return nil, fmt.Errorf("priority %v, want background", p)
	}
	js := f.jobs[ref]
	if n := len(js); n > 0 && !js[n-1].Status().State.Finished() {
		return js[n-1], nil
	}
	j := &fakeJob{st: prefetch.JobStatus{Ref: ref, State: prefetch.StateQueued, Created: time.Now()}, done: make(chan struct{})}
	f.jobs[ref] = append(js, j)
	return j, nil
}

// latest returns the latest job of ref and how many were submitted.
func (f *fakeFetcher) latest(ref string) (*fakeJob, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	js := f.jobs[ref]
	if len(js) == 0 {
		return nil, 0
	}
	return js[len(js)-1], len(js)
}

// fakePinner is a store that holds the blobs in present.
type fakePinner struct {
	mu      sync.Mutex
	present map[digest.Digest]bool
	pins    map[digest.Digest]map[string]bool
}

func (p *fakePinner) Pin(d digest.Digest, owner string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.present[d] {
		return fmt.Errorf("pinning %s: %w", d, content.ErrNotFound)
	}
	if p.pins[d] == nil {
		p.pins[d] = make(map[string]bool)
	}
	p.pins[d][owner] = true
	return nil
}

func (p *fakePinner) Unpin(d digest.Digest, owner string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.pins[d], owner)
	return nil
}

func (p *fakePinner) List() []cache.Info {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []cache.Info
	for d := range p.present {
		info := cache.Info{Descriptor: content.Descriptor{Digest: d, Size: 10}}
		for o := range p.pins[d] {
			info.Pins = append(info.Pins, o)
		}
		out = append(out, info)
	}
	return out
}

func (p *fakePinner) add(ds ...digest.Digest) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, d := range ds {
		p.present[d] = true
	}
}

func (p *fakePinner) pinned(owner string) []digest.Digest {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []digest.Digest
	for d, owners := range p.pins {
		if owners[owner] {
			out = append(out, d)
		}
	}
	return out
}

// TestPolicyWithFakes drives the controller through job outcomes a real
// origin makes hard to time: partial readiness, a failure retried after its
// pause, a blob evicted before it could be pinned, a model dropped from the
// policy, pinning turned off.
func TestPolicyWithFakes(t *testing.T) {
	t.Parallel()
	e, kc, dc := kube(t)
	node, name := uniq("fake-1"), uniq("fake")
	_, err := e.CreateNode(t.Context(), node, map[string]string{"pool": "fake"})
	require.NoError(t, err)
	f := &fakeFetcher{jobs: make(map[string][]*fakeJob)}
	pins := &fakePinner{present: make(map[digest.Digest]bool), pins: make(map[digest.Digest]map[string]bool)}
	c, err := policy.New(node, kc, dc, f, pins, policy.Config{Debounce: 50 * time.Millisecond, RetryBase: 500 * time.Millisecond})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
	})

	const a, b = "hf://org/a@main", "hf://org/b@main"
	owner := policy.PinOwner(name)
	createPolicy(t, dc, name, map[string]string{"pool": "fake"}, []string{a, b}, nil)
	entry := func(what string, cond func(n policy.NodeStatus) bool) policy.NodeStatus {
		t.Helper()
		p := eventually(t, dc, name, what, func(p view) bool {
			n, ok := p.entry(node)
			return ok && n.ObservedGeneration == p.Generation && cond(n)
		})
		n, _ := p.entry(node)
		return n
	}
	entry("both fetching", func(n policy.NodeStatus) bool { return slices.Equal(n.Fetching, []string{a, b}) })

	dA1, dA2, dB := digest.FromString("a1"), digest.FromString("a2"), digest.FromString("b")
	pins.add(dA1, dA2)
	ja, _ := f.latest(a)
	ja.finish([]digest.Digest{dA1, dA2}, "")
	n := entry("a ready", func(n policy.NodeStatus) bool { return slices.Equal(n.Ready, []string{a}) })
	assert.Equal(t, policy.NodeFetching, n.State)
	assert.Equal(t, int64(20), n.Bytes)
	assert.ElementsMatch(t, []digest.Digest{dA1, dA2}, pins.pinned(owner))

	jb, _ := f.latest(b)
	jb.finish(nil, "resolving hf://org/b@main: 404 Not Found")
	n = entry("b failed", func(n policy.NodeStatus) bool { return len(n.Failed) == 1 })
	assert.Equal(t, policy.NodeFailed, n.State)
	assert.Equal(t, policy.Failure{Ref: b, Reason: "resolving hf://org/b@main: 404 Not Found"}, n.Failed[0])

	// Retried after RetryBase; this time ready, but its blob is gone
	// before it is pinned: fetched once more.
	require.Eventually(t, func() bool { _, k := f.latest(b); return k == 2 }, 10*time.Second, 10*time.Millisecond, "retried")
	jb, _ = f.latest(b)
	jb.finish([]digest.Digest{dB}, "")
	require.Eventually(t, func() bool { _, k := f.latest(b); return k == 3 }, 10*time.Second, 10*time.Millisecond, "fetched again")
	pins.add(dB)
	jb, _ = f.latest(b)
	jb.finish([]digest.Digest{dB}, "")
	n = entry("both ready", func(n policy.NodeStatus) bool { return n.State == policy.NodeReady })
	assert.Equal(t, []string{a, b}, n.Ready)
	assert.ElementsMatch(t, []digest.Digest{dA1, dA2, dB}, pins.pinned(owner))

	// a leaves the policy: its blobs are unpinned.
	_, err = dc.Resource(policy.GVR).Patch(t.Context(), name, types.MergePatchType, fmt.Appendf(nil, `{"spec":{"models":[%q]}}`, b), metav1.PatchOptions{})
	require.NoError(t, err)
	entry("only b", func(n policy.NodeStatus) bool { return slices.Equal(n.Ready, []string{b}) })
	require.Eventually(t, func() bool { return slices.Equal(pins.pinned(owner), []digest.Digest{dB}) }, 10*time.Second, 10*time.Millisecond)

	// Pinning turned off: kept, not pinned.
	_, err = dc.Resource(policy.GVR).Patch(t.Context(), name, types.MergePatchType, []byte(`{"spec":{"pin":false}}`), metav1.PatchOptions{})
	require.NoError(t, err)
	entry("still ready", func(n policy.NodeStatus) bool { return n.State == policy.NodeReady })
	require.Eventually(t, func() bool { return len(pins.pinned(owner)) == 0 }, 10*time.Second, 10*time.Millisecond)
	_, k := f.latest(a)
	assert.Equal(t, 1, k, "a ready reference is not fetched again")
}

// writeLog records the times of the PrefetchPolicyNode writes made under
// one field manager.
type writeLog struct {
	manager string
	next    http.RoundTripper
	mu      sync.Mutex
	times   []time.Time
}

func (w *writeLog) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method == http.MethodPatch && strings.Contains(r.URL.Path, "/"+policy.NodeResource+"/") && r.URL.Query().Get("fieldManager") == w.manager {
		w.mu.Lock()
		w.times = append(w.times, time.Now())
		w.mu.Unlock()
	}
	return w.next.RoundTrip(r)
}

func (w *writeLog) writes() []time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.times)
}

// TestPolicyDebounce: references finishing in quick succession make few
// status writes, at least Debounce apart, the last one complete.
func TestPolicyDebounce(t *testing.T) {
	t.Parallel()
	e, _, _ := kube(t)
	node, name := uniq("debounce-1"), uniq("debounce")
	const debounce = time.Second
	log := &writeLog{manager: policy.FieldManager(node)}
	cfg := rest.CopyConfig(e.Config)
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { log.next = rt; return log })
	kc, dc := kubernetes.NewForConfigOrDie(cfg), dynamic.NewForConfigOrDie(cfg)
	_, err := e.CreateNode(t.Context(), node, map[string]string{"pool": "debounce"})
	require.NoError(t, err)
	f := &fakeFetcher{jobs: make(map[string][]*fakeJob)}
	pins := &fakePinner{present: make(map[digest.Digest]bool), pins: make(map[digest.Digest]map[string]bool)}
	reg := prometheus.NewPedanticRegistry()
	c, err := policy.New(node, kc, dc, f, pins, policy.Config{Debounce: debounce, Registerer: reg})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
	})

	var refs []string
	for i := range 10 {
		refs = append(refs, fmt.Sprintf("hf://org/m%d@main", i))
	}
	createPolicy(t, dc, name, map[string]string{"pool": "debounce"}, refs, nil)
	require.Eventually(t, func() bool { return len(log.writes()) > 0 }, 30*time.Second, 10*time.Millisecond, "first write")
	for i, ref := range refs {
		var j *fakeJob
		require.Eventually(t, func() bool { j, _ = f.latest(ref); return j != nil }, 10*time.Second, 5*time.Millisecond)
		d := digest.FromString(ref)
		pins.add(d)
		j.finish([]digest.Digest{d}, "")
		if i%3 == 0 {
			time.Sleep(150 * time.Millisecond)
		}
	}
	eventually(t, dc, name, "all ready", func(p view) bool {
		n, ok := p.entry(node)
		return ok && n.State == policy.NodeReady && len(n.Ready) == len(refs)
	})
	time.Sleep(2 * debounce) // nothing more to write
	ws := log.writes()
	t.Logf("%d status writes for %d references", len(ws), len(refs))
	assert.LessOrEqual(t, len(ws), 4, "10 references finishing within half a second: a first write, and few more")
	for i := 1; i < len(ws); i++ {
		assert.GreaterOrEqual(t, ws[i].Sub(ws[i-1]), debounce-50*time.Millisecond, "writes %d and %d", i-1, i)
	}
	// The metrics count the same writes.
	assert.Equal(t, float64(len(ws)), metricValue(t, reg, "weightd_policy_status_writes_total", "kind", "entry", "outcome", "ok"))
	assert.Equal(t, 0.0, metricValue(t, reg, "weightd_policy_status_writes_total", "kind", "entry", "outcome", "error"))
	assert.Equal(t, 1.0, metricValue(t, reg, "weightd_policy_selected"))
	assert.Equal(t, float64(len(refs)), metricValue(t, reg, "weightd_policy_pinned_blobs"))
}

// metricValue is the value of the metric name with the given label pairs.
func metricValue(t *testing.T, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
						found = true
					}
				}
				if !found {
					continue metrics
				}
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue()
			case m.Gauge != nil:
				return m.GetGauge().GetValue()
			}
		}
	}
	t.Fatalf("metric %s%v not found", name, labels)
	return 0
}
