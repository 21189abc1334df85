package monitoring

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/services"
)

const (
	// promtoolTests holds the alerts' unit tests in promtool's format.
	promtoolTests = "testdata/promtool"
	// rulesFile is the name the unit tests' rule_files give the chart's
	// rules, which chartRules writes beside copies of them.
	rulesFile = "weightd-rules.yaml"
)

// chartRules returns the rule groups of deploy/monitoring's PrometheusRule,
// the chart's as `make manifests` renders them (test/deploy fails while the
// two differ), as a plain Prometheus rules file, and its alerts' names.
func chartRules(t *testing.T) (file []byte, alerts []string) {
	t.Helper()
	data, err := os.ReadFile(monitoring + "/prometheusrule.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var raw struct {
		Kind string `json:"kind"`
		Spec struct {
			Groups json.RawMessage `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(data, &raw); err != nil {
		t.Fatalf("prometheusrule.yaml: %v", err)
	}
	if raw.Kind != "PrometheusRule" || len(raw.Spec.Groups) == 0 {
		t.Fatalf("prometheusrule.yaml: a %q without spec.groups, want a PrometheusRule", raw.Kind)
	}
	var f ruleFile
	if err := yaml.Unmarshal(data, &f); err != nil {
		t.Fatalf("prometheusrule.yaml: %v", err)
	}
	for _, g := range f.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				alerts = append(alerts, r.Alert)
			}
		}
	}
	// The groups as they are, not through ruleFile: a plain rules file
	// holds exactly what the PrometheusRule's spec does.
	j, err := json.Marshal(map[string]json.RawMessage{"groups": raw.Spec.Groups})
	if err != nil {
		t.Fatal(err)
	}
	file, err = yaml.JSONToYAML(j)
	if err != nil {
		t.Fatal(err)
	}
	return file, alerts
}

// promtoolTestFile is the part of a promtool unit test file that
// TestAlertsTested reads.
type promtoolTestFile struct {
	RuleFiles []string `json:"rule_files"`
	Tests     []struct {
		Name          string `json:"name"`
		AlertRuleTest []struct {
			Alertname string            `json:"alertname"`
			ExpAlerts []json.RawMessage `json:"exp_alerts"`
		} `json:"alert_rule_test"`
	} `json:"tests"`
}

// promtoolTestFiles returns the paths of the unit test files.
func promtoolTestFiles(t *testing.T) []string {
	t.Helper()
	paths, err := filepath.Glob(promtoolTests + "/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) == 0 {
		t.Fatalf("no unit tests under %s", promtoolTests)
	}
	return paths
}

// TestAlertsTested checks, without promtool, that the unit tests cover
// every alert: each has a case where it fires and one where it must not,
// and no case names an alert the rules lack (promtool passes a case that
// expects no alert of a name no rule has).
func TestAlertsTested(t *testing.T) {
	_, alerts := chartRules(t)
	fires, quiet := map[string]int{}, map[string]int{}
	for _, p := range promtoolTestFiles(t) {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var f promtoolTestFile
		if err := yaml.Unmarshal(data, &f); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if !slices.Equal(f.RuleFiles, []string{rulesFile}) {
			t.Errorf("%s: rule_files %q, want [%s] (the chart's rules, as TestPromtoolRules writes them)", p, f.RuleFiles, rulesFile)
		}
		for _, tg := range f.Tests {
			for _, c := range tg.AlertRuleTest {
				if !slices.Contains(alerts, c.Alertname) {
					t.Errorf("%s: test %q: no alert %s in the rules", p, tg.Name, c.Alertname)
				}
				if len(c.ExpAlerts) > 0 {
					fires[c.Alertname]++
				} else {
					quiet[c.Alertname]++
				}
			}
		}
	}
	for _, a := range alerts {
		if fires[a] == 0 || quiet[a] == 0 {
			t.Errorf("alert %s: %d cases where it fires and %d where it must not, want at least one of each", a, fires[a], quiet[a])
		}
	}
	t.Logf("%d alerts; cases where they fire %v, where they must not %v", len(alerts), fires, quiet)
}

// TestPromtoolRules runs promtool on the chart's alerts (chartRules): `check
// rules` with every lint, then `test rules` on each unit test file under
// testdata/promtool, failing with promtool's output. It skips where
// promtool is not built (make promtool), except under CI=true.
func TestPromtoolRules(t *testing.T) {
	promtool := services.RequirePromtool(t)
	dir := t.TempDir()
	rules, _ := chartRules(t)
	if err := os.WriteFile(filepath.Join(dir, rulesFile), rules, 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(t *testing.T, args ...string) {
		t.Helper()
		cmd := exec.CommandContext(t.Context(), promtool, args...)
		cmd.Dir = dir // rule_files are relative to the test file
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	t.Run("check", func(t *testing.T) {
		run(t, "check", "rules", "--lint=all", "--lint-fatal", rulesFile)
	})
	for _, p := range promtoolTestFiles(t) {
		name := filepath.Base(p)
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Run(strings.TrimSuffix(name, ".yaml"), func(t *testing.T) {
			run(t, "test", "rules", name)
		})
	}
}
