package catalog

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// module writes a module of the given files (path → source) into a
// temporary directory and returns it.
func module(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	files["go.mod"] = "module example.com/m\n\ngo 1.26\n"
	for name, src := range files {
		p := filepath.Join(root, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

const names = `package names

const Namespace = "weightd"
`

const metrics = `package a

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	prom "github.com/prometheus/client_golang/prometheus"

	"example.com/m/names"
)

const sub = "cache"

var jobLabels = []string{"kind", "outcome"}

type collector struct{ used, slots *prometheus.Desc }

func build(r prometheus.Registerer) {
	prometheus.NewCounter(prometheus.CounterOpts{Name: "weightd_hits_total", Help: "Hits."})
	prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: names.Namespace, Subsystem: sub, Name: "stored_bytes", Help: "Stored."}, []string{"state"})
	prom.NewHistogramVec(prom.HistogramOpts{Name: "weightd_" + "job_seconds", Help: "Jobs."}, jobLabels)
	prometheus.NewSummary(prometheus.SummaryOpts{Name: "weightd_scrape_seconds", Help: "Scrapes.", ConstLabels: prometheus.Labels{"source": "x"}})
	prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "weightd_peers", Help: "Peers."}, func() float64 { return 0 })
	promauto.With(r).NewCounterVec(prometheus.CounterOpts{Name: "weightd_loads_total", Help: "Loads."}, []string{"runtime"})
	c := &collector{
		used: prometheus.NewDesc(prometheus.BuildFQName("weightd", "gpu", "memory_used_bytes"), "Used.", []string{"gpu"}, nil),
	}
	c.slots = prometheus.NewDesc("weightd_slots", "Slots.", nil, prometheus.Labels{"state": "free"})
	_ = c
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(c.used, prometheus.GaugeValue, 1, "0")
	ch <- prometheus.MustNewConstMetric(c.slots, prometheus.GaugeValue, 1)
}
`

func TestScan(t *testing.T) {
	root := module(t, map[string]string{
		"names/names.go": names,
		"a/a.go":         metrics,
		// Not scanned: tests, testdata, hidden directories.
		"a/a_test.go":           `package a; import "github.com/prometheus/client_golang/prometheus"; var _ = prometheus.NewGauge(prometheus.GaugeOpts{Name: "weightd_test"})`,
		"a/testdata/x.go":       `package x; import "github.com/prometheus/client_golang/prometheus"; var _ = prometheus.NewGauge(prometheus.GaugeOpts{Name: "weightd_testdata"})`,
		".hidden/x.go":          `package x; import "github.com/prometheus/client_golang/prometheus"; var _ = prometheus.NewGauge(prometheus.GaugeOpts{Name: "weightd_hidden"})`,
		"b/other_prometheus.go": `package b; import prometheus "example.com/m/names"; var _ = prometheus.NewGauge(1)`,
	})
	cat, err := Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	want := []Metric{
		{Name: "weightd_cache_stored_bytes", Type: Gauge, Labels: []string{"state"}, Help: "Stored."},
		{Name: "weightd_gpu_memory_used_bytes", Type: Gauge, Labels: []string{"gpu"}, Help: "Used."},
		{Name: "weightd_hits_total", Type: Counter, Help: "Hits."},
		{Name: "weightd_job_seconds", Type: Histogram, Labels: []string{"kind", "outcome"}, Help: "Jobs."},
		{Name: "weightd_loads_total", Type: Counter, Labels: []string{"runtime"}, Help: "Loads."},
		{Name: "weightd_peers", Type: Gauge, Help: "Peers."},
		{Name: "weightd_scrape_seconds", Type: Summary, Labels: []string{"source"}, Help: "Scrapes."},
		{Name: "weightd_slots", Type: Gauge, Labels: []string{"state"}, Help: "Slots."},
	}
	if len(cat.Metrics) != len(want) {
		t.Fatalf("found %d metrics, want %d: %+v", len(cat.Metrics), len(want), cat.Metrics)
	}
	for i, m := range cat.Metrics {
		w := want[i]
		if m.Name != w.Name || m.Type != w.Type || !slices.Equal(m.Labels, w.Labels) || m.Help != w.Help ||
			!slices.Equal(m.Sources, []string{"a/a.go"}) {
			t.Errorf("metric %d = %+v, want %+v from a/a.go", i, m, w)
		}
	}
	if problems := cat.Lint(); len(problems) > 0 {
		t.Errorf("lint: %v", problems)
	}
}

func TestScanSeries(t *testing.T) {
	cat := &Catalogue{}
	for _, m := range []Metric{
		{Name: "weightd_a_seconds", Type: Histogram},
		{Name: "weightd_b_seconds", Type: Summary},
		{Name: "weightd_c_total", Type: Counter},
	} {
		if err := cat.add(m); err != nil {
			t.Fatal(err)
		}
	}
	for name, want := range map[string]string{
		"weightd_a_seconds": "weightd_a_seconds", "weightd_a_seconds_bucket": "weightd_a_seconds",
		"weightd_a_seconds_count": "weightd_a_seconds", "weightd_b_seconds_sum": "weightd_b_seconds",
		"weightd_b_seconds_bucket": "", "weightd_c_total_count": "", "weightd_d": "", "weightd_c_total": "weightd_c_total",
	} {
		m, ok := cat.Series(name)
		if ok != (want != "") || m.Name != want {
			t.Errorf("Series(%s) = %q, %v; want %q", name, m.Name, ok, want)
		}
	}
}

// TestScanErrors: what the catalogue cannot read is an error naming the
// file and line, never a metric left out.
func TestScanErrors(t *testing.T) {
	const head = "package a\n\nimport \"github.com/prometheus/client_golang/prometheus\"\n\n"
	for name, tc := range map[string]struct{ src, want string }{
		"computed name": {`func f(n string) { prometheus.NewGauge(prometheus.GaugeOpts{Name: n}) }`, "a/a.go:5: n is not a string constant"},
		"computed labels": {`func f(l []string) { prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "weightd_x"}, l) }`,
			"a/a.go:5: l is not a label list"},
		"opts variable": {`var o = prometheus.GaugeOpts{Name: "weightd_x"}; var _ = prometheus.NewGauge(o)`, "is not an Opts literal"},
		"no name":       {`var _ = prometheus.NewGauge(prometheus.GaugeOpts{Help: "x"})`, "metric without a name"},
		"conflict": {`var _ = prometheus.NewGauge(prometheus.GaugeOpts{Name: "weightd_x"})
var _ = prometheus.NewCounter(prometheus.CounterOpts{Name: "weightd_x"})`, "metric weightd_x is a"},
		"label twice": {`var _ = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "weightd_x", ConstLabels: prometheus.Labels{"a": "1"}}, []string{"a"})`,
			"has a label twice"},
		"desc unbound": {`func f() { g(prometheus.NewDesc("weightd_x", "", nil, nil)) }; func g(*prometheus.Desc) {}`, "NewDesc not assigned"},
		"desc untyped": {`var d = prometheus.NewDesc("weightd_x", "", nil, nil)`, "no const metric is made from d"},
		"desc two types": {`var d = prometheus.NewDesc("weightd_x", "", nil, nil)
func f() { prometheus.MustNewConstMetric(d, prometheus.GaugeValue, 1); prometheus.MustNewConstHistogram(d, 1, 1, nil) }`, "const metrics of types"},
		"value type": {`var d = prometheus.NewDesc("weightd_x", "", nil, nil)
func f(v prometheus.ValueType) { prometheus.MustNewConstMetric(d, v, 1) }`, "value type is not"},
	} {
		t.Run(name, func(t *testing.T) {
			root := module(t, map[string]string{"a/a.go": head + tc.src + "\n"})
			_, err := Scan(root)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Scan: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestLint(t *testing.T) {
	for _, tc := range []struct {
		m    Metric
		want string
	}{
		{Metric{Name: "cache_hits_total", Type: Counter, Help: "x"}, "does not start with weightd_"},
		{Metric{Name: "weightd_Hits_total", Type: Counter, Help: "x"}, "not lower snake case"},
		{Metric{Name: "weightd_hits_total", Type: Counter}, "no help text"},
		{Metric{Name: "weightd_hits", Type: Counter, Help: "x"}, "does not end in _total"},
		{Metric{Name: "weightd_peers_total", Type: Gauge, Help: "x"}, "ends in _total"},
		{Metric{Name: "weightd_load_time", Type: Histogram, Help: "x"}, "does not end in a unit"},
		{Metric{Name: "weightd_load_milliseconds", Type: Histogram, Help: "x"}, `unit "milliseconds"`},
		{Metric{Name: "weightd_disk_used_percent", Type: Gauge, Help: "x"}, `unit "percent"`},
		{Metric{Name: "weightd_build_info", Type: Counter, Help: "x"}, "info metric"},
		{Metric{Name: "weightd_hit_ratio", Type: Histogram, Help: "x"}, "is a ratio"},
		{Metric{Name: "weightd_blob_bytes", Type: Gauge, Help: "x", Labels: []string{"digest"}}, `label "digest", unbounded`},
		{Metric{Name: "weightd_blob_bytes", Type: Gauge, Help: "x", Labels: []string{"model"}}, `label "model", unbounded`},
		{Metric{Name: "weightd_blob_bytes", Type: Gauge, Help: "x", Labels: []string{"colour"}}, `label "colour", not in the allowlist`},
		{Metric{Name: "weightd_prefetch_ready_seconds", Type: Histogram, Help: "x"}, `allows the label "model", which it does not have`},
		{Metric{Name: "weightd_queue_length", Type: Counter, Help: "x"}, "counter metrics should have \"_total\" suffix (promlint)"},
	} {
		cat := &Catalogue{}
		if err := cat.add(tc.m); err != nil {
			t.Fatal(err)
		}
		problems := cat.Lint()
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, tc.want) }) {
			t.Errorf("Lint(%+v) = %q, want a problem containing %q", tc.m, problems, tc.want)
		}
	}
	ok := &Catalogue{}
	for _, m := range []Metric{
		{Name: "weightd_prefetch_ready_seconds", Type: Histogram, Help: "x", Labels: []string{"model"}},
		{Name: "weightd_build_info", Type: Gauge, Help: "x", Labels: []string{"commit", "version"}},
		{Name: "weightd_received_bytes_total", Type: Counter, Help: "x", Labels: []string{"source"}},
	} {
		if err := ok.add(m); err != nil {
			t.Fatal(err)
		}
	}
	if problems := ok.Lint(); len(problems) > 0 {
		t.Errorf("Lint of good metrics: %q", problems)
	}
}

func TestMarkdown(t *testing.T) {
	cat := &Catalogue{}
	if err := cat.add(Metric{Name: "weightd_a_total", Type: Counter, Help: "A | b\nc.", Labels: []string{"kind", "outcome"}, Sources: []string{"pkg/a/a.go"}}); err != nil {
		t.Fatal(err)
	}
	page := string(cat.Markdown("make metrics-doc"))
	for _, want := range []string{
		"`make metrics-doc`",
		"| `weightd_a_total` | counter | `kind`, `outcome` | A \\| b c. | `pkg/a/a.go` |\n",
		"| `kind` | " + Labels["kind"] + " |\n",
		"| `weightd_prefetch_ready_seconds` | `model` |",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q:\n%s", want, page)
		}
	}
}
