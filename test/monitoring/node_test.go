package monitoring

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/histogram"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/relabel"
	"github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/tsdb/chunkenc"
	"github.com/prometheus/prometheus/tsdb/chunks"
	"github.com/prometheus/prometheus/util/annotations"
	"sigs.k8s.io/yaml"
)

// relabeling is one of a Prometheus Operator monitor's relabelings, in the
// operator's camelCase.
type relabeling struct {
	SourceLabels []string `json:"sourceLabels"`
	Separator    string   `json:"separator"`
	TargetLabel  string   `json:"targetLabel"`
	Regex        string   `json:"regex"`
	Replacement  *string  `json:"replacement"`
	Action       string   `json:"action"`
}

func (r relabeling) config(t *testing.T) *relabel.Config {
	t.Helper()
	c := relabel.DefaultRelabelConfig
	c.NameValidationScheme = model.UTF8Validation
	for _, l := range r.SourceLabels {
		c.SourceLabels = append(c.SourceLabels, model.LabelName(l))
	}
	c.TargetLabel = r.TargetLabel
	if r.Separator != "" {
		c.Separator = r.Separator
	}
	if r.Regex != "" {
		c.Regex = relabel.MustNewRegexp(r.Regex)
	}
	if r.Replacement != nil {
		c.Replacement = *r.Replacement
	}
	if r.Action != "" {
		c.Action = relabel.Action(strings.ToLower(r.Action))
	}
	return &c
}

// operatorRelabelings are the relabelings the Prometheus Operator (v0.8x,
// pkg/prometheus/promcfg.go, generatePodMonitorConfig) puts before a
// PodMonitor's own: namespace, container, pod and endpoint from the pod's
// metadata, job from the monitor. It sets no node label.
func operatorRelabelings(t *testing.T) []*relabel.Config {
	t.Helper()
	var out []*relabel.Config
	for _, r := range []relabeling{
		{SourceLabels: []string{"__meta_kubernetes_namespace"}, TargetLabel: "namespace"},
		{SourceLabels: []string{"__meta_kubernetes_pod_container_name"}, TargetLabel: "container"},
		{SourceLabels: []string{"__meta_kubernetes_pod_name"}, TargetLabel: "pod"},
		{SourceLabels: []string{"__meta_kubernetes_pod_container_port_name"}, TargetLabel: "endpoint"},
		{TargetLabel: "job", Replacement: ptr("weightd-system/weightd")},
	} {
		out = append(out, r.config(t))
	}
	return out
}

func ptr[T any](v T) *T { return &v }

// scrapeTarget is one agent as Kubernetes service discovery finds it.
type scrapeTarget struct{ node, podIP string }

var agents = []scrapeTarget{{"gpu-a", "10.0.0.5"}, {"gpu-b", "10.0.1.7"}}

// targetLabels labels a scrape of the agent on tg as Prometheus does for
// the PodMonitor deploy/monitoring/podmonitor.yaml: the discovered meta
// labels through the operator's relabelings and the monitor's, instance
// from the address, the meta labels dropped.
func scrapeLabels(t *testing.T, tg scrapeTarget) labels.Labels {
	t.Helper()
	data, err := os.ReadFile(monitoring + "/podmonitor.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var pm struct {
		Spec struct {
			PodMetricsEndpoints []struct {
				Relabelings []relabeling `json:"relabelings"`
			} `json:"podMetricsEndpoints"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(data, &pm); err != nil {
		t.Fatal(err)
	}
	if len(pm.Spec.PodMetricsEndpoints) != 1 {
		t.Fatalf("podmonitor.yaml has %d endpoints, want 1", len(pm.Spec.PodMetricsEndpoints))
	}
	cfgs := operatorRelabelings(t)
	for _, r := range pm.Spec.PodMetricsEndpoints[0].Relabelings {
		cfgs = append(cfgs, r.config(t))
	}
	lb := labels.NewBuilder(labels.FromStrings(
		"__address__", tg.podIP+":9464",
		"__meta_kubernetes_namespace", "weightd-system",
		"__meta_kubernetes_pod_name", "weightd-"+tg.node,
		"__meta_kubernetes_pod_container_name", "agent",
		"__meta_kubernetes_pod_container_port_name", "metrics",
		"__meta_kubernetes_pod_node_name", tg.node,
	))
	if !relabel.ProcessBuilder(lb, cfgs...) {
		t.Fatalf("the relabelings drop the target on %s", tg.node)
	}
	if lb.Get("instance") == "" {
		lb.Set("instance", lb.Get("__address__"))
	}
	lb.Range(func(l labels.Label) {
		if strings.HasPrefix(l.Name, "__") {
			lb.Del(l.Name)
		}
	})
	return lb.Labels()
}

// seriesFor returns, for each metric expr selects, a series per target
// with a value for each label it matches on (but the target labels).
func seriesFor(t *testing.T, expr string, targets []labels.Labels) []labels.Labels {
	t.Helper()
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	var out []labels.Labels
	for _, vs := range selectors(e) {
		lb := labels.NewBuilder(labels.EmptyLabels())
		for _, m := range vs.LabelMatchers {
			if m.Name == "__name__" || slices.Contains(targetLabelNames, m.Name) {
				continue
			}
			v := slices.IndexFunc(matcherValues, m.Matches)
			if v < 0 {
				t.Fatalf("%s: no test value matches %s", expr, m)
			}
			lb.Set(m.Name, matcherValues[v])
		}
		les := []string{""}
		if strings.HasSuffix(name(vs), "_bucket") {
			les = []string{"1", "+Inf"}
		}
		for _, tl := range targets {
			for _, le := range les {
				tl.Range(func(l labels.Label) { lb.Set(l.Name, l.Value) })
				lb.Set("le", le)
				lb.Set("__name__", name(vs))
				out = append(out, lb.Labels())
			}
		}
	}
	return out
}

// memSeries is an in-memory storage.Queryable: each series rises by 10 a
// minute from 0 at time 0 for 30 minutes, as a counter or gauge would.
func memSeries(series []labels.Labels) storage.Queryable {
	var samples []chunks.Sample
	for i := range 31 {
		samples = append(samples, floatSample{t: int64(i) * time.Minute.Milliseconds(), f: float64(10 * i)})
	}
	return &storage.MockQueryable{MockQuerier: &storage.MockQuerier{
		SelectMockFunction: func(_ bool, _ *storage.SelectHints, ms ...*labels.Matcher) storage.SeriesSet {
			set := &seriesSet{i: -1}
			for _, l := range series {
				if !slices.ContainsFunc(ms, func(m *labels.Matcher) bool { return !m.Matches(l.Get(m.Name)) }) {
					set.series = append(set.series, storage.NewListSeries(l, samples))
				}
			}
			slices.SortFunc(set.series, func(a, b storage.Series) int { return labels.Compare(a.Labels(), b.Labels()) })
			set.series = slices.CompactFunc(set.series, func(a, b storage.Series) bool { return labels.Equal(a.Labels(), b.Labels()) })
			return set
		},
	}}
}

type floatSample struct {
	t int64
	f float64
}

func (s floatSample) T() int64                      { return s.t }
func (s floatSample) ST() int64                     { return 0 }
func (s floatSample) F() float64                    { return s.f }
func (s floatSample) H() *histogram.Histogram       { return nil }
func (s floatSample) FH() *histogram.FloatHistogram { return nil }
func (s floatSample) Type() chunkenc.ValueType      { return chunkenc.ValFloat }
func (s floatSample) Copy() chunks.Sample           { return s }

type seriesSet struct {
	series []storage.Series
	i      int
}

func (s *seriesSet) Next() bool                        { s.i++; return s.i < len(s.series) }
func (s *seriesSet) At() storage.Series                { return s.series[s.i] }
func (s *seriesSet) Err() error                        { return nil }
func (s *seriesSet) Warnings() annotations.Annotations { return nil }

// targetLabelNames are the labels scrapeLabels sets.
var targetLabelNames = []string{"instance", "job", "namespace", "pod", "container", "endpoint", "node"}

// matcherValues are label values tried, in order, for a matcher.
var matcherValues = []string{"origin", "failed", "ready", "ok", "unhealthy", "peer", "m"}

// TestDashboardNodeVariable evaluates the dashboard's node variable and
// every panel's query on series labelled as Prometheus labels the agents'
// scrapes through the chart's PodMonitor: the variable lists the nodes'
// names, and choosing one node gives what that node's series alone give.
func TestDashboardNodeVariable(t *testing.T) {
	data, err := os.ReadFile(monitoring + "/dashboards/weightd-cold-start.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatal(err)
	}
	var both, alone []labels.Labels
	for _, a := range agents {
		both = append(both, scrapeLabels(t, a))
	}
	alone = both[:1]
	engine := promql.NewEngine(promql.EngineOpts{MaxSamples: 1e6, Timeout: time.Minute, LookbackDelta: 5 * time.Minute})
	at := time.Unix(0, 0).Add(30 * time.Minute)
	eval := func(t *testing.T, series []labels.Labels, q string) promql.Vector {
		t.Helper()
		qry, err := engine.NewInstantQuery(t.Context(), memSeries(series), nil, q, at)
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		res := qry.Exec(t.Context())
		if res.Err != nil {
			t.Fatalf("%s: %v", q, res.Err)
		}
		v, err := res.Vector()
		if err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return v
	}

	var nodeVar *variable
	for i, v := range d.Templating.List {
		if v.Name == "node" {
			nodeVar = &d.Templating.List[i]
		}
	}
	if nodeVar == nil {
		t.Fatal("the dashboard has no variable named node")
	}
	var q struct {
		Query string `json:"query"`
	}
	if err := json.Unmarshal(nodeVar.Query, &q); err != nil {
		t.Fatal(err)
	}
	mm := labelValues.FindStringSubmatch(q.Query)
	if mm == nil {
		t.Fatalf("node variable: %q is not label_values(metric, label)", q.Query)
	}
	var values []string
	for _, s := range eval(t, seriesFor(t, mm[1], both), fmt.Sprintf("group by (%s) (%s)", mm[2], mm[1])) {
		values = append(values, s.Metric.Get(mm[2]))
	}
	slices.Sort(values)
	if want := []string{"gpu-a", "gpu-b"}; !slices.Equal(values, want) {
		t.Errorf("node variable %q lists %q, want the nodes' names %q", q.Query, values, want)
	}

	exprs := 0
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			walk(p.Panels)
			for _, tg := range p.Targets {
				exprs++
				one := dashboardQuery(tg.Expr, "gpu-a")
				got := eval(t, seriesFor(t, one, both), one)
				want := eval(t, seriesFor(t, one, alone), dashboardQuery(tg.Expr, ".*"))
				if len(want) == 0 {
					t.Errorf("panel %q: %s gives nothing on one node's series", p.Title, tg.Expr)
				}
				if got.String() != want.String() {
					t.Errorf("panel %q with node gpu-a:\n  %s\ngives\n  %v\nwant (gpu-a's series alone)\n  %v", p.Title, one, got, want)
				}
			}
		}
	}
	walk(d.Panels)
	if exprs == 0 {
		t.Fatal("the dashboard has no queries")
	}
}

// dashboardQuery is expr as Grafana sends it with node chosen and every
// other variable at All (".*"), over 5m rate intervals and a 10m range.
func dashboardQuery(expr, node string) string {
	expr = grafanaRanges.ReplaceAllStringFunc(expr, func(s string) string {
		if strings.Contains(s, "__range") {
			return "10m"
		}
		return "5m"
	})
	return grafanaVars.ReplaceAllStringFunc(expr, func(v string) string {
		if strings.Trim(v, "${}") == "node" {
			return node
		}
		return ".*"
	})
}
