package warmpool

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/lora"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

func TestEnsureStagesLoadsAndHits(t *testing.T) {
	t.Parallel()
	for _, kind := range []engine.Kind{engine.VLLM, engine.SGLang} {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, serverOpts{kind: kind, slots: 2})
			ref := f.adapter("sql", loratest.AdapterSpec{})
			ans := f.mustEnsure("", ref, "")
			name := AdapterName(ref)
			if ans.Model != name || !ans.Loaded || ans.Server != "ai/warm-0" || ans.Endpoint != f.servers[0].URL() {
				t.Fatalf("answer %+v", ans)
			}
			digest, err := contentDigest(filepath.Join(f.fetch.root, "sql"))
			if err != nil {
				t.Fatal(err)
			}
			staged := filepath.Join(f.cfg.StageDir, stageName(name, digest))
			if got := f.servers[0].Loaded()[name]; got != staged {
				t.Fatalf("server loaded %s from %q, want %q", name, got, staged)
			}
			if _, err := lora.Inspect(staged); err != nil {
				t.Fatalf("staged adapter: %v", err)
			}
			again := f.mustEnsure("", ref, "")
			if again.Loaded || again.Model != name {
				t.Fatalf("second answer %+v", again)
			}
			if n := f.servers[0].Loads(name); n != 1 {
				t.Fatalf("%d loads, want 1", n)
			}
			if got := testutil.ToFloat64(f.pool.m.loads.WithLabelValues(string(kind), outcomeOK)); got != 1 {
				t.Fatalf("loads_total{ok} = %v", got)
			}
			if got := testutil.ToFloat64(f.pool.m.slots.WithLabelValues("used")); got != 1 {
				t.Fatalf("slots{used} = %v", got)
			}
			entries, err := os.ReadDir(f.cfg.StageDir)
			if err != nil || len(entries) != 1 || entries[0].Name() != filepath.Base(staged) {
				t.Fatalf("stage dir holds %v (%v), want only %s", entries, err, filepath.Base(staged))
			}
		})
	}
}

func TestServerStageDir(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 1})
	// The servers see the stage directory under another path.
	seen := filepath.Join(t.TempDir(), "adapters")
	if err := os.Symlink(f.cfg.StageDir, seen); err != nil {
		t.Fatal(err)
	}
	f.cfg.ServerStageDir = seen
	f.pool = f.newPool()
	f.mustEnsure("", f.adapter("a", loratest.AdapterSpec{}), "a")
	digest, err := contentDigest(filepath.Join(f.fetch.root, "a"))
	if err != nil {
		t.Fatal(err)
	}
	if got := f.servers[0].Loaded()["a"]; got != filepath.Join(seen, stageName("a", digest)) {
		t.Fatalf("loaded from %q", got)
	}
}

func TestBadRequests(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 2, maxRank: 16})
	good := f.adapter("good", loratest.AdapterSpec{})
	high := f.adapter("high", loratest.AdapterSpec{Rank: 32})
	noConfig := f.adapter("no-config", loratest.AdapterSpec{})
	os.Remove(filepath.Join(f.fetch.root, "no-config", lora.ConfigFile))
	noWeights := f.adapter("no-weights", loratest.AdapterSpec{})
	os.Remove(filepath.Join(f.fetch.root, "no-weights", lora.WeightsFile))
	badJSON := f.adapter("bad-json", loratest.AdapterSpec{})
	os.WriteFile(filepath.Join(f.fetch.root, "bad-json", lora.ConfigFile), []byte(`{"r": 8,`), 0o644)
	cut := f.adapter("cut", loratest.AdapterSpec{})
	os.Truncate(filepath.Join(f.fetch.root, "cut", lora.WeightsFile), 100)
	header := f.adapter("header", loratest.AdapterSpec{})
	os.WriteFile(filepath.Join(f.fetch.root, "header", lora.WeightsFile), []byte("\xff\xff\xff\xff\xff\xff\xff\x7f{}"), 0o644)

	for _, tc := range []struct {
		name string
		req  api.AdapterRequest
		want error
	}{
		{"unknown base", api.AdapterRequest{Base: "hf://org/other@main", Ref: good}, api.ErrNotFound},
		{"no ref", api.AdapterRequest{Base: testBase}, api.ErrBadRequest},
		{"bad name", api.AdapterRequest{Base: testBase, Ref: good, Name: "../etc"}, api.ErrBadRequest},
		{"rank over the maximum", api.AdapterRequest{Base: testBase, Ref: high}, api.ErrBadRequest},
		{"missing config", api.AdapterRequest{Base: testBase, Ref: noConfig}, api.ErrBadRequest},
		{"missing weights", api.AdapterRequest{Base: testBase, Ref: noWeights}, api.ErrBadRequest},
		{"corrupt config", api.AdapterRequest{Base: testBase, Ref: badJSON}, api.ErrBadRequest},
		{"truncated weights", api.AdapterRequest{Base: testBase, Ref: cut}, api.ErrBadRequest},
		{"corrupt safetensors header", api.AdapterRequest{Base: testBase, Ref: header}, api.ErrBadRequest},
	} {
		_, err := f.pool.Ensure(t.Context(), tc.req)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
	if n := f.loadCalls.Load(); n != 0 {
		t.Fatalf("the runtime was sent %d loads; every bad adapter must be caught before", n)
	}
	if got := f.loaded(0); len(got) != 0 {
		t.Fatalf("pool lists %v", got)
	}
	if entries, _ := os.ReadDir(f.cfg.StageDir); len(entries) != 0 {
		t.Fatalf("stage dir holds %v", entries)
	}
	// A name given to one reference is not given to another.
	f.mustEnsure("", good, "taken")
	other := f.adapter("other", loratest.AdapterSpec{})
	if _, err := f.ensure("", other, "taken"); !errors.Is(err, api.ErrBadRequest) {
		t.Fatalf("name conflict: %v", err)
	}
}

func TestRuntimeFaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		fault   func(s *loratest.Server)
		clear   func(s *loratest.Server)
		outcome string
	}{
		{"timeout", func(s *loratest.Server) { s.SetHang(true) }, func(s *loratest.Server) { s.SetHang(false) }, outcomeUnavailable},
		{"500", func(s *loratest.Server) { s.FailNext(1) }, func(*loratest.Server) {}, outcomeUnavailable},
		{"success without listing", func(s *loratest.Server) { s.SetLie(true) }, func(s *loratest.Server) { s.SetLie(false) }, outcomeUnlisted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, serverOpts{slots: 1})
			f.cfg.LoadTimeout, f.cfg.CallTimeout = 300*time.Millisecond, 300*time.Millisecond
			f.pool = f.newPool()
			ref := f.adapter("a", loratest.AdapterSpec{})
			tc.fault(f.servers[0])
			if _, err := f.ensure("", ref, "a"); err == nil {
				t.Fatal("ensure succeeded")
			}
			if got := testutil.ToFloat64(f.pool.m.loads.WithLabelValues("vllm", tc.outcome)); got != 1 {
				t.Fatalf("loads_total{%s} = %v", tc.outcome, got)
			}
			if got := f.loaded(0); len(got) != 0 {
				t.Fatalf("pool lists %v after a failed load", got)
			}
			if got := testutil.ToFloat64(f.pool.m.slots.WithLabelValues("free")); got != 1 {
				t.Fatalf("slots{free} = %v: the failed load kept its slot", got)
			}
			tc.clear(f.servers[0])
			f.pool.checkAll(t.Context())
			if ans := f.mustEnsure("", ref, "a"); !ans.Loaded {
				t.Fatalf("answer %+v", ans)
			}
			if got := f.servers[0].Loaded(); len(got) != 1 {
				t.Fatalf("server holds %v", got)
			}
		})
	}
}

func TestServerKilledMidLoad(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 2})
	keep := f.adapter("keep", loratest.AdapterSpec{})
	f.mustEnsure("pod-1", keep, "keep")
	ref := f.adapter("a", loratest.AdapterSpec{})
	f.servers[0].KillOnNextLoad()
	if _, err := f.ensure("pod-2", ref, "a"); err == nil {
		t.Fatal("ensure succeeded on a killed server")
	}
	f.pool.checkAll(t.Context())
	if s := f.pool.Servers()[0]; s.Healthy || s.Error == "" {
		t.Fatalf("server %+v: want unhealthy", s)
	}
	if _, err := f.ensure("pod-2", ref, "a"); !errors.Is(err, api.ErrBusy) {
		t.Fatalf("ensure with no healthy server: %v, want busy", err)
	}
	if err := f.servers[0].Restart(); err != nil {
		t.Fatal(err)
	}
	f.pool.checkAll(t.Context())
	// The adapter in use came back; the one that was loading is not there.
	if got := f.servers[0].Loaded(); len(got) != 1 || got["keep"] == "" {
		t.Fatalf("server holds %v after its restart", got)
	}
	if ans := f.mustEnsure("pod-2", ref, "a"); !ans.Loaded {
		t.Fatalf("answer %+v", ans)
	}
	if got := f.loaded(0); !slices.Equal(got, []string{"a", "keep"}) {
		t.Fatalf("pool lists %v", got)
	}
}

// Two pods ask at once for different adapters when one slot is left: one
// gets the slot, the other evicts an idle adapter if there is one, else
// fails busy; the server never holds more than its slots.
func TestTwoPodsOneSlotLeft(t *testing.T) {
	t.Parallel()
	for _, inUse := range []bool{true, false} {
		t.Run(map[bool]string{true: "nothing evictable", false: "one idle adapter"}[inUse], func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, serverOpts{slots: 2})
			first := f.adapter("first", loratest.AdapterSpec{})
			owner := ""
			if inUse {
				owner = "pod-0"
			}
			f.mustEnsure(owner, first, "first")
			b, c := f.adapter("b", loratest.AdapterSpec{}), f.adapter("c", loratest.AdapterSpec{})
			f.servers[0].SetDelay(20 * time.Millisecond) // both in flight together
			var wg sync.WaitGroup
			errs := make([]error, 2)
			for i, ref := range []string{b, c} {
				wg.Go(func() { _, errs[i] = f.ensure("pod-"+ref, ref, "") })
			}
			wg.Wait()
			if peak := f.servers[0].Peak(); peak > 2 {
				t.Fatalf("server held %d adapters at once, slots 2", peak)
			}
			ok := 0
			for _, err := range errs {
				switch {
				case err == nil:
					ok++
				case inUse && errors.Is(err, api.ErrBusy):
				default:
					t.Fatalf("ensure: %v", err)
				}
			}
			want := 1
			if !inUse {
				want = 2
			}
			if ok != want {
				t.Fatalf("%d of 2 ensures succeeded, want %d (errors %v)", ok, want, errs)
			}
			if got := f.servers[0].Loaded(); len(got) != 2 {
				t.Fatalf("server holds %v", got)
			}
		})
	}
}

func TestConcurrentEnsuresCoalesce(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 4}, serverOpts{slots: 4})
	ref := f.adapter("a", loratest.AdapterSpec{})
	f.servers[0].SetDelay(20 * time.Millisecond)
	f.servers[1].SetDelay(20 * time.Millisecond)
	const n = 8
	answers := make([]api.AdapterAnswer, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { answers[i], errs[i] = f.ensure("", ref, "a") })
	}
	wg.Wait()
	loaded := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if answers[i].Model != "a" || answers[i].Server != answers[0].Server {
			t.Fatalf("answers %+v and %+v", answers[i], answers[0])
		}
		if answers[i].Loaded {
			loaded++
		}
	}
	if got := f.servers[0].Loads("a") + f.servers[1].Loads("a"); got != 1 || loaded != 1 || f.loadCalls.Load() != 1 {
		t.Fatalf("%d loads, %d load requests, %d answers say loaded; want 1 each", got, f.loadCalls.Load(), loaded)
	}
}

func TestLRUNeverEvictsPinnedOrInUse(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 3})
	refs := map[string]string{}
	for _, n := range []string{"pinned", "used", "idle", "new1", "new2", "new3", "new4"} {
		refs[n] = f.adapter(n, loratest.AdapterSpec{})
	}
	if _, err := f.pool.Ensure(t.Context(), api.AdapterRequest{Base: testBase, Ref: refs["pinned"], Name: "pinned", Pin: true}); err != nil {
		t.Fatal(err)
	}
	f.mustEnsure("pod-1", refs["used"], "used")
	f.mustEnsure("", refs["idle"], "idle")
	// pinned and used are older than idle, but only idle may go.
	f.mustEnsure("", refs["new1"], "new1")
	if got := f.loaded(0); !slices.Equal(got, []string{"new1", "pinned", "used"}) {
		t.Fatalf("after new1: %v", got)
	}
	f.mustEnsure("", refs["new2"], "new2")
	if got := f.loaded(0); !slices.Equal(got, []string{"new2", "pinned", "used"}) {
		t.Fatalf("after new2: %v", got)
	}
	// A hit makes new2 recent; releasing pod-1 makes used the oldest idle one.
	f.pool.Release("pod-1")
	f.mustEnsure("", refs["new2"], "new2")
	f.mustEnsure("", refs["new3"], "new3")
	if got := f.loaded(0); !slices.Equal(got, []string{"new2", "new3", "pinned"}) {
		t.Fatalf("after new3: %v", got)
	}
	// Everything pinned or in use: busy, nothing unloaded.
	f.mustEnsure("pod-2", refs["new2"], "new2")
	f.mustEnsure("pod-3", refs["new3"], "new3")
	if _, err := f.ensure("", refs["new4"], "new4"); !errors.Is(err, api.ErrBusy) {
		t.Fatalf("ensure with every slot taken: %v, want busy", err)
	}
	if !f.pool.Unpin(testBase, "pinned") {
		t.Fatal("Unpin found nothing pinned")
	}
	f.mustEnsure("", refs["new4"], "new4")
	if got := f.loaded(0); !slices.Equal(got, []string{"new2", "new3", "new4"}) {
		t.Fatalf("after unpinning: %v", got)
	}
	if got := testutil.ToFloat64(f.pool.m.evictions.WithLabelValues("vllm")); got != 4 {
		t.Fatalf("evictions_total = %v, want 4", got)
	}
	if peak := f.servers[0].Peak(); peak > 3 {
		t.Fatalf("peak %d adapters, slots 3", peak)
	}
	// Evicted adapters are no longer staged.
	entries, _ := os.ReadDir(f.cfg.StageDir)
	if len(entries) != 3 {
		t.Fatalf("stage dir holds %d entries, want 3", len(entries))
	}
}

func TestAgentRestartRebuildsFromServers(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 2}, serverOpts{kind: engine.SGLang, slots: 2})
	a, b := f.adapter("a", loratest.AdapterSpec{}), f.adapter("b", loratest.AdapterSpec{})
	f.mustEnsure("", a, "a")
	f.mustEnsure("", b, "b")
	// A new agent: a new pool on the same stage directory and servers.
	f.pool = f.newPool()
	var total int
	for _, s := range f.pool.Servers() {
		total += len(s.Adapters)
	}
	if total != 2 {
		t.Fatalf("rebuilt pool lists %+v", f.pool.Servers())
	}
	for _, ref := range []string{a, b} {
		name := strings.TrimPrefix(ref, "test://")
		if ans := f.mustEnsure("", ref, name); ans.Loaded {
			t.Fatalf("%s loaded again after the restart", name)
		}
	}
	if n := f.loadCalls.Load(); n != 2 {
		t.Fatalf("%d load requests, want 2", n)
	}
}

func TestServerRestartReloadsInUse(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 3})
	used, pinned, idle := f.adapter("used", loratest.AdapterSpec{}), f.adapter("pinned", loratest.AdapterSpec{}), f.adapter("idle", loratest.AdapterSpec{})
	f.mustEnsure("pod-1", used, "used")
	if _, err := f.pool.Ensure(t.Context(), api.AdapterRequest{Base: testBase, Ref: pinned, Name: "pinned", Pin: true}); err != nil {
		t.Fatal(err)
	}
	f.mustEnsure("", idle, "idle")
	if err := f.servers[0].Restart(); err != nil {
		t.Fatal(err)
	}
	f.pool.checkAll(t.Context())
	if got := f.loaded(0); !slices.Equal(got, []string{"pinned", "used"}) {
		t.Fatalf("after the server's restart the pool lists %v", got)
	}
	if got := f.servers[0].Loaded(); len(got) != 2 || got["used"] == "" || got["pinned"] == "" {
		t.Fatalf("server holds %v", got)
	}
	if got := testutil.ToFloat64(f.pool.m.reloads.WithLabelValues("vllm")); got != 2 {
		t.Fatalf("reloads_total = %v", got)
	}
	// The forgotten one loads again on demand.
	if ans := f.mustEnsure("", idle, "idle"); !ans.Loaded {
		t.Fatalf("answer %+v", ans)
	}
}

// Run checks the servers by itself: it keeps their bases, notices a
// restart and reloads what is in use; SetServers drops a server gone.
func TestRun(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 2})
	f.cfg.GPUUse = func(uid string) ([]string, uint64) { return []string{"GPU-" + uid}, 40 << 30 }
	p := f.runPool(t)
	p.SetServers(f.specs)
	waitFor(t, p, func(s []api.WarmServer) bool { return len(s) == 1 && s[0].Healthy })
	if s := p.Servers()[0]; !slices.Equal(s.GPUs, []string{"GPU-uid-0"}) {
		t.Fatalf("server %+v", s)
	}
	if got := testutil.ToFloat64(p.m.baseMemory.WithLabelValues(testBase)); got != 40<<30 {
		t.Fatalf("base_gpu_memory_bytes = %v", got)
	}
	ref := f.adapter("a", loratest.AdapterSpec{})
	f.mustEnsure("pod-1", ref, "a")
	if err := f.servers[0].Restart(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, p, func([]api.WarmServer) bool { return f.servers[0].Loads("a") == 2 && len(f.loaded(0)) == 1 })
	p.SetServers(nil)
	waitFor(t, p, func(s []api.WarmServer) bool { return len(s) == 0 })
	// A check that catches the restart between stop and start sees the
	// server down and drops its base, then keeps it again: every keep is
	// matched by a drop, and the removal dropped the last.
	kept, dropped := f.bases.snapshot()
	if len(kept) == 0 || len(kept) != len(dropped) || slices.ContainsFunc(append(kept, dropped...), func(pod string) bool { return pod != "ai/warm-0" }) {
		t.Fatalf("kept %v, dropped %v", kept, dropped)
	}
}

// waitFor waits, on the pool's change notifications, until ok holds of its
// servers; it fails the test after a generous bound.
// A server found down has its base dropped; removing it then drops
// nothing more: every Keep is matched by exactly one Drop.
func TestRemovingADownServerDropsItsBaseOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 2})
	p := f.runPool(t)
	p.SetServers(f.specs)
	waitFor(t, p, func(s []api.WarmServer) bool {
		kept, _ := f.bases.snapshot()
		return len(s) == 1 && s[0].Healthy && len(kept) == 1
	})
	f.servers[0].Close()
	waitFor(t, p, func(s []api.WarmServer) bool {
		_, dropped := f.bases.snapshot()
		return len(s) == 1 && !s[0].Healthy && len(dropped) == 1
	})
	p.SetServers(nil)
	waitFor(t, p, func(s []api.WarmServer) bool { return len(s) == 0 })
	if kept, dropped := f.bases.snapshot(); len(kept) != 1 || len(dropped) != 1 {
		t.Fatalf("kept %v, dropped %v: want one of each", kept, dropped)
	}
}

// runPool makes the fixture's pool, checking its servers every 10 ms, and
// runs it until the test ends.
func (f *fixture) runPool(t *testing.T) *Pool {
	t.Helper()
	f.cfg.HealthInterval = 10 * time.Millisecond
	f.cfg.Registerer = prometheus.NewRegistry()
	p, err := New(f.cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.pool = p
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return p
}

func waitFor(t *testing.T, p *Pool, ok func([]api.WarmServer) bool) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for !ok(p.Servers()) {
		select {
		case <-p.Changed():
		case <-deadline:
			t.Fatalf("servers never got there: %+v", p.Servers())
		}
	}
}

func TestAdapterName(t *testing.T) {
	t.Parallel()
	for ref, prefix := range map[string]string{
		"hf://org/sql-lora@main":                  "sql-lora-",
		"oci://ghcr.io/acme/loras/chat:v1":        "chat-",
		"https://host/a/b/model.json?sig=1#x":     "model-",
		"hf://org/Ünïcode lora@main":              "n-code-lora-",
		"hf://org/...@main":                       "lora-",
		"https://host/" + strings.Repeat("x", 99): strings.Repeat("x", 55) + "-",
	} {
		got := AdapterName(ref)
		if !engine.ValidAdapterName(got) || !strings.HasPrefix(got, prefix) || len(got) != len(prefix)+8 {
			t.Errorf("AdapterName(%q) = %q, want %s + 8 hex digits", ref, got, prefix)
		}
	}
	if AdapterName("hf://org/a@v1") == AdapterName("hf://org/a@v2") {
		t.Error("two revisions share a name")
	}
	for _, bad := range []string{"", ".", "..", "-x", "a/b", "a b", strings.Repeat("a", 65)} {
		if engine.ValidAdapterName(bad) {
			t.Errorf("engine.ValidAdapterName(%q)", bad)
		}
	}
}

func FuzzAdapterName(f *testing.F) {
	for _, s := range []string{"hf://org/a@main", "oci://r/x:1", "", "://", "@@@", "hf://x/ü#?"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ref string) {
		if n := AdapterName(ref); !engine.ValidAdapterName(n) {
			t.Fatalf("AdapterName(%q) = %q, not a valid name", ref, n)
		}
	})
}

func TestNewCleansHalfStaged(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	left := filepath.Join(dir, stageTmpPrefix+"a-123")
	if err := os.MkdirAll(left, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := New(Config{StageDir: dir, Fetcher: &dirFetcher{}, Bases: &recBases{}}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(left); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("half-staged directory still there: %v", err)
	}
	if _, err := New(Config{StageDir: dir}); err == nil {
		t.Fatal("New without Fetcher and Bases succeeded")
	}
}

// A server takes adapters for pods of its own namespace, a shared one for
// every namespace; a request without a namespace (the node's local API) may
// use any server.
func TestEnsureNamespaces(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 4}, serverOpts{slots: 1})
	f.specs[0].Pod = "team-a/warm"
	f.specs[1].Pod, f.specs[1].Shared = "inference/warm", true
	f.pool = f.newPool()
	ref := f.adapter("sql", loratest.AdapterSpec{})
	ensure := func(ns, name string) (api.AdapterAnswer, error) {
		return f.pool.EnsureFor(t.Context(), "", api.AdapterRequest{Base: testBase, Ref: ref, Name: name, Namespace: ns})
	}
	if ans, err := ensure("team-b", "b"); err != nil || ans.Server != "inference/warm" {
		t.Fatalf("team-b: %+v, %v; want the shared server", ans, err)
	}
	f.fetch.mu.Lock()
	if got := f.fetch.requesters; len(got) != 1 || got[0] != "team-b" {
		t.Errorf("fetches on behalf of %q, want [team-b]: the agent's credentials follow the pod's namespace", got)
	}
	f.fetch.mu.Unlock()
	// The shared server's one slot holds b (evictable): team-c is served
	// there too, never by team-a's server with its free slots.
	if ans, err := ensure("team-c", "c"); err != nil || ans.Server != "inference/warm" {
		t.Fatalf("team-c: %+v, %v; want the shared server", ans, err)
	}
	if ans, err := ensure("team-a", "a"); err != nil || ans.Server != "team-a/warm" {
		t.Fatalf("team-a: %+v, %v; want its own server (the most free slots)", ans, err)
	}
	// team-a's adapter is loaded on team-a's server only: another namespace
	// asking for the same name and reference is not served from there.
	if ans, err := ensure("team-b", "a"); err != nil || ans.Server != "inference/warm" {
		t.Fatalf("team-b asking for a: %+v, %v; want the shared server", ans, err)
	}
	f.specs = f.specs[:1]
	f.pool = f.newPool()
	if _, err := ensure("team-b", "b"); !errors.Is(err, api.ErrNotFound) {
		t.Fatalf("team-b with only team-a's server: %v, want not found", err)
	}
	if ans, err := ensure("", "b"); err != nil || ans.Server != "team-a/warm" {
		t.Fatalf("the local API: %+v, %v; want any server", ans, err)
	}
}

// After a restart of the agent, an adapter found loaded has no recorded
// reference: a request for its name with other weights must load those,
// not be answered by the old ones.
func TestAgentRestartReloadsChangedAdapter(t *testing.T) {
	t.Parallel()
	for _, kind := range []engine.Kind{engine.VLLM, engine.SGLang} {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, serverOpts{kind: kind, slots: 2})
			v1 := f.adapter("v1", loratest.AdapterSpec{Rank: 8})
			v2 := f.adapter("v2", loratest.AdapterSpec{Rank: 16})
			f.mustEnsure("", v1, "x")
			oldPath := f.servers[0].Loaded()["x"]
			f.pool = f.newPool()
			ans := f.mustEnsure("", v2, "x")
			if !ans.Loaded {
				t.Fatalf("adapter x with new weights answered from the old ones: %+v", ans)
			}
			path := f.servers[0].Loaded()["x"]
			if path == oldPath {
				t.Fatalf("new weights staged at the old path %s", path)
			}
			info, err := lora.Inspect(path)
			if err != nil {
				t.Fatal(err)
			}
			if info.Rank != 16 {
				t.Fatalf("server serves rank %d under x, want the new rank 16", info.Rank)
			}
			if _, err := os.Stat(oldPath); !os.IsNotExist(err) {
				t.Fatalf("old staged weights still at %s: %v", oldPath, err)
			}
			// The same reference again: a hit, no load.
			calls := f.loadCalls.Load()
			if ans := f.mustEnsure("", v2, "x"); ans.Loaded || f.loadCalls.Load() != calls {
				t.Fatalf("second ensure of the same weights loaded again: %+v", ans)
			}
		})
	}
}

// An SGLang release that lists no adapter in /v1/models: loads are known
// from the load answers, evictions from the unload answers.
func TestOlderSGLangWithoutListing(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{kind: engine.SGLang, slots: 2, older: true})
	refs := []string{f.adapter("a", loratest.AdapterSpec{}), f.adapter("b", loratest.AdapterSpec{}), f.adapter("c", loratest.AdapterSpec{})}
	for _, ref := range refs {
		if ans := f.mustEnsure("", ref, ""); !ans.Loaded {
			t.Fatalf("ensure %s: %+v", ref, ans)
		}
	}
	f.pool.checkAll(t.Context())
	if got := f.loaded(0); len(got) != 2 || len(f.servers[0].Loaded()) != 2 {
		t.Fatalf("pool lists %v, server holds %v", got, f.servers[0].Loaded())
	}
	if n := f.servers[0].Unloads(AdapterName(refs[0])); n != 1 {
		t.Fatalf("least recently used adapter unloaded %d times, want 1", n)
	}
}

// vLLM takes loads past --max-loras (evicting from its own caches), so the
// pool must bound what it loads by the server's slots itself.
func TestVLLMPastMaxLorasBoundedByPool(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{slots: 2})
	for _, name := range []string{"a", "b", "c", "d"} {
		f.mustEnsure("", f.adapter(name, loratest.AdapterSpec{}), name)
	}
	if peak := f.servers[0].Peak(); peak != 2 {
		t.Fatalf("server held %d adapters at once, want at most its 2 slots", peak)
	}
	if got := testutil.ToFloat64(f.pool.m.slots.WithLabelValues("used")); got != 2 {
		t.Fatalf("slots{used} = %v", got)
	}
}

// SGLang refuses to pin every slot of its batch (at most
// --max-loras-per-batch − 1): the pool never asks it to, and keeps its own
// pin on the adapter it loaded unpinned.
func TestSGLangPinsBelowBatchSlots(t *testing.T) {
	t.Parallel()
	f := newFixture(t, serverOpts{kind: engine.SGLang, slots: 2, perBatch: 2})
	for _, name := range []string{"a", "b"} {
		req := api.AdapterRequest{Base: testBase, Ref: f.adapter(name, loratest.AdapterSpec{}), Name: name, Pin: true}
		if _, err := f.pool.EnsureFor(t.Context(), "", req); err != nil {
			t.Fatalf("pinned ensure of %s: %v", name, err)
		}
	}
	if got := f.servers[0].Pinned(); !slices.Equal(got, []string{"a"}) {
		t.Fatalf("SGLang holds %v pinned, want [a]", got)
	}
	_, err := f.ensure("", f.adapter("c", loratest.AdapterSpec{}), "c")
	if !errors.Is(err, api.ErrBusy) {
		t.Fatalf("a third adapter with both slots pinned: %v, want busy", err)
	}
}

// The path a runtime lists an adapter under is the runtime's word: it names
// a stage directory of that adapter only in the one exact form.
func FuzzStageDigestOf(f *testing.F) {
	f.Add("/stage", "a", "/stage/a.0123456789abcdef0123456789abcdef")
	f.Add("/stage", "a", "/stage/a.0123456789ABCDEF0123456789abcdef")
	f.Add("/stage", "a", "/other/a.0123456789abcdef0123456789abcdef")
	f.Add("/stage", "a", "/stage/a")
	f.Add("/stage", "a.b", "/stage/a.b.0123456789abcdef0123456789abcdef")
	f.Fuzz(func(t *testing.T, root, name, path string) {
		digest := stageDigestOf(root, name, path)
		if digest == "" {
			return
		}
		if len(digest) != digestLen || strings.Trim(digest, "0123456789abcdef") != "" {
			t.Fatalf("digest %q", digest)
		}
		if filepath.Join(filepath.Clean(root), stageName(name, digest)) != filepath.Clean(path) {
			t.Fatalf("%q is not the stage directory of %q under %q", path, name, root)
		}
	})
}
