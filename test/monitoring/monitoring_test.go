package monitoring

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"text/template"

	"github.com/prometheus/common/model"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/metricscatalog/catalog"
)

const (
	root       = "../.."
	monitoring = root + "/deploy/monitoring"
)

var (
	catOnce sync.Once
	cat     *catalog.Catalogue
	catErr  error
)

// catalogue is the metrics catalogue of the repository, scanned once.
func catalogue(t *testing.T) *catalog.Catalogue {
	t.Helper()
	catOnce.Do(func() { cat, catErr = catalog.Scan(root) })
	if catErr != nil {
		t.Fatal(catErr)
	}
	return cat
}

// dashboard is the part of a Grafana dashboard the tests read.
type dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int             `json:"id"`
	Title      string          `json:"title"`
	Type       string          `json:"type"`
	Datasource json.RawMessage `json:"datasource"`
	Targets    []struct {
		Expr       string          `json:"expr"`
		Datasource json.RawMessage `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's panels
}

type variable struct {
	Name  string          `json:"name"`
	Type  string          `json:"type"`
	Query json.RawMessage `json:"query"`
}

// datasourceRef is the datasource every panel and target must name: the
// dashboard's datasource variable, so that it imports into any Grafana.
const datasourceRef = `{"type":"prometheus","uid":"${datasource}"}`

var labelValues = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$`)

// checkDashboard parses a dashboard and checks its panels' expressions, its
// datasources and its query variables against cat.
func checkDashboard(cat *catalog.Catalogue, data []byte) (exprs int, err error) {
	var d dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		return 0, fmt.Errorf("parsing the dashboard: %w", err)
	}
	var errs []error
	if d.UID == "" || d.Title == "" {
		errs = append(errs, errors.New("dashboard without a uid or title"))
	}
	vars := map[string]variable{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			if err := json.Unmarshal(v.Query, &q.Query); err != nil {
				errs = append(errs, fmt.Errorf("variable %s: query: %w", v.Name, err))
				continue
			}
		}
		mm := labelValues.FindStringSubmatch(q.Query)
		if mm == nil {
			errs = append(errs, fmt.Errorf("variable %s: query %q is not label_values(metric, label)", v.Name, q.Query))
			continue
		}
		m, ok := cat.Series(mm[1])
		if !ok || !hasLabel(m, mm[1], mm[2]) {
			errs = append(errs, fmt.Errorf("variable %s: no metric %s with the label %s", v.Name, mm[1], mm[2]))
		}
	}
	if v, ok := vars["datasource"]; !ok || v.Type != "datasource" {
		errs = append(errs, errors.New("no datasource variable named datasource"))
	}
	ids := map[int]bool{}
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			if ids[p.ID] {
				errs = append(errs, fmt.Errorf("panel id %d twice", p.ID))
			}
			ids[p.ID] = true
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if len(p.Targets) == 0 {
				errs = append(errs, fmt.Errorf("panel %q has no queries", p.Title))
			}
			if !sameJSON(p.Datasource, datasourceRef) {
				errs = append(errs, fmt.Errorf("panel %q: datasource %s, want %s", p.Title, p.Datasource, datasourceRef))
			}
			for _, tg := range p.Targets {
				exprs++
				if !sameJSON(tg.Datasource, datasourceRef) {
					errs = append(errs, fmt.Errorf("panel %q: target datasource %s, want %s", p.Title, tg.Datasource, datasourceRef))
				}
				for _, v := range grafanaVars.FindAllString(tg.Expr, -1) {
					name := strings.Trim(v, "${}")
					if _, ok := vars[name]; !ok && !strings.HasPrefix(name, "__") {
						errs = append(errs, fmt.Errorf("panel %q uses the undefined variable %s", p.Title, v))
					}
				}
				if err := checkExpr(cat, tg.Expr); err != nil {
					errs = append(errs, fmt.Errorf("panel %q: %w", p.Title, err))
				}
			}
		}
	}
	walk(d.Panels)
	return exprs, errors.Join(errs...)
}

func sameJSON(raw json.RawMessage, want string) bool {
	var a, b any
	return json.Unmarshal(raw, &a) == nil && json.Unmarshal([]byte(want), &b) == nil && fmt.Sprint(a) == fmt.Sprint(b)
}

// ruleFile is the part of a PrometheusRule the tests read.
type ruleFile struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name      string            `json:"name"`
		Namespace string            `json:"namespace"`
		Labels    map[string]string `json:"labels"`
	} `json:"metadata"`
	Spec struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Alert       string            `json:"alert"`
				Record      string            `json:"record"`
				Expr        string            `json:"expr"`
				For         string            `json:"for"`
				Labels      map[string]string `json:"labels"`
				Annotations map[string]string `json:"annotations"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

// templateFuncs are Prometheus's alert template functions, by name, so that
// annotations parse as Prometheus parses them.
var templateFuncs = template.FuncMap{}

func init() {
	for _, name := range []string{"humanize", "humanize1024", "humanizeDuration", "humanizePercentage",
		"humanizeTimestamp", "toTime", "title", "toUpper", "toLower", "match", "reReplaceAll", "label", "value",
		"first", "query", "strvalue", "args", "safeHtml", "externalURL", "pathPrefix", "graphLink", "tableLink",
		"sortByLabel", "stripPort", "stripDomain", "parseDuration", "now"} {
		templateFuncs[name] = func(...any) any { return nil }
	}
}

// checkRules parses a PrometheusRule and checks every rule: its expression
// against cat; an alert's name, a `for` duration, a severity label, and
// summary and description annotations that parse as templates.
func checkRules(cat *catalog.Catalogue, data []byte) (alerts int, err error) {
	var f ruleFile
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return 0, fmt.Errorf("parsing the rules: %w", err)
	}
	if f.APIVersion != "monitoring.coreos.com/v1" || f.Kind != "PrometheusRule" {
		return 0, fmt.Errorf("%s %s is not a monitoring.coreos.com/v1 PrometheusRule", f.APIVersion, f.Kind)
	}
	var errs []error
	names := map[string]bool{}
	for _, g := range f.Spec.Groups {
		for _, r := range g.Rules {
			what := r.Alert + r.Record
			if err := checkExpr(cat, r.Expr); err != nil {
				errs = append(errs, fmt.Errorf("rule %s: %w", what, err))
			}
			if r.Alert == "" {
				continue
			}
			alerts++
			if names[r.Alert] {
				errs = append(errs, fmt.Errorf("alert %s twice", r.Alert))
			}
			names[r.Alert] = true
			if !strings.HasPrefix(r.Alert, "Weightd") {
				errs = append(errs, fmt.Errorf("alert %s does not start with Weightd", r.Alert))
			}
			if d, err := model.ParseDuration(r.For); err != nil || d <= 0 {
				errs = append(errs, fmt.Errorf("alert %s: for %q is not a positive duration", r.Alert, r.For))
			}
			if !slices.Contains([]string{"critical", "warning", "info"}, r.Labels["severity"]) {
				errs = append(errs, fmt.Errorf("alert %s: severity %q is not critical, warning or info", r.Alert, r.Labels["severity"]))
			}
			for _, a := range []string{"summary", "description"} {
				text := r.Annotations[a]
				if strings.TrimSpace(text) == "" {
					errs = append(errs, fmt.Errorf("alert %s has no %s annotation", r.Alert, a))
					continue
				}
				if _, err := template.New(a).Funcs(templateFuncs).Parse("{{$labels := .Labels}}{{$value := .Value}}" + text); err != nil {
					errs = append(errs, fmt.Errorf("alert %s: %s: %w", r.Alert, a, err))
				}
			}
		}
	}
	return alerts, errors.Join(errs...)
}

// files returns the files under deploy/monitoring whose names end in ext.
func files(t *testing.T, ext string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(monitoring, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ext) {
			out = append(out, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestDashboards(t *testing.T) {
	cat := catalogue(t)
	paths := files(t, ".json")
	if len(paths) == 0 {
		t.Fatal("no dashboards under deploy/monitoring")
	}
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		n, err := checkDashboard(cat, data)
		if err != nil {
			t.Errorf("%s:\n%v", p, err)
		}
		t.Logf("%s: %d expressions", p, n)
	}
}

func TestRules(t *testing.T) {
	cat := catalogue(t)
	alerts := 0
	for _, p := range files(t, ".yaml") {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var head struct{ Kind string }
		if err := yaml.Unmarshal(data, &head); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if head.Kind != "PrometheusRule" {
			continue
		}
		n, err := checkRules(cat, data)
		if err != nil {
			t.Errorf("%s:\n%v", p, err)
		}
		alerts += n
	}
	// The alerts the issue asks for, at least.
	if alerts < 5 {
		t.Errorf("%d alerts, want at least 5", alerts)
	}
}

// TestKustomize builds deploy/monitoring with kubectl: the dashboard lands in
// a ConfigMap for Grafana's sidecar, next to the PodMonitor and the rules.
func TestKustomize(t *testing.T) {
	kc, err := exec.LookPath("kubectl")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but no kubectl: %v", err)
		}
		t.Skipf("skipping: no kubectl: %v", err)
	}
	out, err := exec.CommandContext(t.Context(), kc, "kustomize", monitoring).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl kustomize: %v\n%s", err, out)
	}
	kinds := map[string]bool{}
	for _, doc := range strings.Split(string(out), "\n---\n") {
		var obj struct {
			Kind     string `json:"kind"`
			Metadata struct {
				Namespace string            `json:"namespace"`
				Labels    map[string]string `json:"labels"`
			} `json:"metadata"`
			Data map[string]string `json:"data"`
		}
		if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
			t.Fatal(err)
		}
		kinds[obj.Kind] = true
		if obj.Metadata.Namespace != "weightd-system" {
			t.Errorf("%s in namespace %q", obj.Kind, obj.Metadata.Namespace)
		}
		if obj.Kind == "ConfigMap" {
			if obj.Metadata.Labels["grafana_dashboard"] != "1" {
				t.Errorf("dashboard ConfigMap labels %v lack grafana_dashboard=1", obj.Metadata.Labels)
			}
			want, err := os.ReadFile(filepath.Join(monitoring, "dashboards", "weightd-cold-start.json"))
			if err != nil {
				t.Fatal(err)
			}
			if obj.Data["weightd-cold-start.json"] != string(want) {
				t.Error("the ConfigMap does not hold dashboards/weightd-cold-start.json")
			}
		}
	}
	for _, k := range []string{"ConfigMap", "PodMonitor", "PrometheusRule"} {
		if !kinds[k] {
			t.Errorf("kubectl kustomize made no %s (made %v)", k, kinds)
		}
	}
}
