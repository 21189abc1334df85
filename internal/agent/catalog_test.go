package agent

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/weightd/weightd/internal/metricscatalog/catalog"
	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/nvml/nvmltest"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/pkg/prefetch"
)

// dtoTypes are the catalogue's types of the exposition's metric types.
var dtoTypes = map[dto.MetricType]catalog.Type{
	dto.MetricType_COUNTER: catalog.Counter, dto.MetricType_GAUGE: catalog.Gauge,
	dto.MetricType_HISTOGRAM: catalog.Histogram, dto.MetricType_SUMMARY: catalog.Summary,
	dto.MetricType_UNTYPED: catalog.Untyped,
}

// TestMetricsInCatalogue runs an agent wired by New, with sharing and
// the registry mirror on, fetches a model from a local origin so that the
// labelled metrics have series, gathers its registry and checks every
// weightd_* family against the catalogue scanned from the source
// (docs/metrics.md): same type, same labels on every series, and promlint
// finds nothing.
func TestMetricsInCatalogue(t *testing.T) {
	t.Parallel()
	cat, err := catalog.Scan(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	url, _ := startOrigin(t, 2, 2<<20)
	dir := testdisk.ShortDir(t)
	addr := "unix://" + filepath.Join(dir, "api.sock")
	ca, err := peertls.WriteCA(dir, "catalog test CA")
	if err != nil {
		t.Fatal(err)
	}
	a := runAgent(t, Config{
		Root: filepath.Join(dir, "cache"), API: addr, ChunkSize: 1 << 20, MaxJobs: 2, ShutdownTimeout: 5 * time.Second,
		P2PConfig: P2PConfig{GossipAddr: "127.0.0.1:0", ChunkAddr: "127.0.0.1:0", OriginFetchers: 1, MaxUploads: 4, FastGossip: true,
			PeerCAFile: ca.CA, PeerCAKeyFile: ca.Key},
		MirrorConfig: MirrorConfig{MirrorAddr: "127.0.0.1:0", MirrorRegistries: []string{"registry.invalid"}},
		// The origin listens on loopback.
		SourcesConfig: SourcesConfig{FetchAllowCIDRs: []string{"127.0.0.0/8"}},
		// Every optional part on: the warm pool with its DRAM tier, the load
		// tracer (attached as root, else its metrics say unavailable), GPUs on
		// a fake DGX H100.
		WarmConfig:      WarmConfig{Warm: true, WarmDRAMBudget: 1 << 20},
		LoadTraceConfig: LoadTraceConfig{LoadTrace: true},
		NVML:            nvmltest.NewDGXH100(),
	})
	if st := fetchWait(t, addr, url); st.State != prefetch.StateReady {
		t.Fatalf("fetch: %s: %s", st.State, st.Error)
	}

	// The local API shows what the optional parts see: the fake's 8 GPUs.
	client, err := api.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	st, err := client.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(st.GPUs) != 8 {
		t.Errorf("status lists %d GPUs, want the fake DGX H100's 8", len(st.GPUs))
	}
	mfs, err := a.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	families := 0
	for _, mf := range mfs {
		name := mf.GetName()
		if !strings.HasPrefix(name, catalog.Prefix) {
			continue
		}
		families++
		m, ok := cat.Lookup(name)
		if !ok {
			t.Errorf("%s is exported but not in the catalogue (run go run ./internal/metricscatalog -w docs/metrics.md)", name)
			continue
		}
		if typ := dtoTypes[mf.GetType()]; typ != m.Type {
			t.Errorf("%s is exported as a %s, catalogued as a %s", name, typ, m.Type)
		}
		for _, s := range mf.GetMetric() {
			var labels []string
			for _, l := range s.GetLabel() {
				labels = append(labels, l.GetName())
			}
			slices.Sort(labels)
			if !slices.Equal(labels, m.Labels) {
				t.Errorf("%s is exported with the labels %v, catalogued with %v", name, labels, m.Labels)
				break
			}
		}
	}
	// The cache, the queue, sharing, the mirror, the API and the build at least.
	if families < 20 {
		t.Errorf("the agent exported %d weightd_* families, want at least 20", families)
	}
	for _, want := range []string{
		"weightd_prefetch_ready_seconds", "weightd_p2p_peers", "weightd_mirror_requests_total", "weightd_cache_stored_bytes",
		"weightd_gpu_available", "weightd_gpu_memory_used_bytes", "weightd_warmpool_adapter_slots",
		"weightd_dram_tier_budget_bytes", "weightd_loadtrace_available",
	} {
		if !slices.ContainsFunc(mfs, func(mf *dto.MetricFamily) bool { return mf.GetName() == want }) {
			t.Errorf("the agent exported no %s after a fetch", want)
		}
	}
	problems, err := testutil.GatherAndLint(a.reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		if strings.HasPrefix(p.Metric, catalog.Prefix) {
			t.Errorf("promlint: %s: %s", p.Metric, p.Text)
		}
	}
}
