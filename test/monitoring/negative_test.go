package monitoring

import (
	"strings"
	"testing"

	"github.com/weightd/weightd/internal/metricscatalog/catalog"
)

// fixture is a small catalogue for the negative tests.
func fixture(t *testing.T) *catalog.Catalogue {
	t.Helper()
	cat := catalogue(t)
	for _, name := range []string{"weightd_p2p_received_bytes_total", "weightd_p2p_peers", "weightd_cache_ingest_seconds"} {
		if _, ok := cat.Lookup(name); !ok {
			t.Fatalf("the catalogue lacks %s, which these tests use", name)
		}
	}
	return cat
}

func TestExprGood(t *testing.T) {
	cat := fixture(t)
	for _, e := range []string{
		`sum by (source) (rate(weightd_p2p_received_bytes_total{instance=~"$instance"}[$__rate_interval]))`,
		`histogram_quantile(0.95, sum by (le) (rate(weightd_cache_ingest_seconds_bucket[${__range}])))`,
		`weightd_p2p_peers < on () group_left () (0.5 * (count(weightd_p2p_peers) - 1))`,
		`sum(rate(weightd_cache_ingest_seconds_sum[5m])) / sum(rate(weightd_cache_ingest_seconds_count[5m]))`,
	} {
		if err := checkExpr(cat, e); err != nil {
			t.Errorf("%v", err)
		}
	}
}

// TestExprBad: a typo'd metric or label, or a metric used against its type,
// fails the check.
func TestExprBad(t *testing.T) {
	cat := fixture(t)
	for expr, want := range map[string]string{
		`sum(rate(weightd_p2p_recieved_bytes_total[5m]))`: "weightd_p2p_recieved_bytes_total: weightd defines no such metric",
		`weightd_p2p_peer`: "weightd_p2p_peer: weightd defines no such metric",
		`sum(rate({__name__="weightd_cache_hit_total"}[5m]))`:                 "weightd_cache_hit_total: weightd defines no such metric",
		`sum(rate(weightd_p2p_received_bytes_total{sourse="peer"}[5m]))`:      `has no label "sourse"`,
		`sum by (sourse) (rate(weightd_p2p_received_bytes_total[5m]))`:        `has the label "sourse"`,
		`weightd_p2p_received_bytes_total`:                                    "is a counter",
		`rate(weightd_p2p_peers[5m])`:                                         "is a gauge",
		`weightd_cache_ingest_seconds`:                                        "select its _bucket",
		`histogram_quantile(0.9, rate(weightd_cache_ingest_seconds_sum[5m]))`: "over no _bucket series",
		`rate(weightd_p2p_peers_bucket[5m])`:                                  "no such metric",
		`sum(rate(weightd_p2p_received_bytes_total[5m])`:                      "parsing",
	} {
		err := checkExpr(cat, expr)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("checkExpr(%s) = %v, want an error containing %q", expr, err, want)
		}
	}
}

func TestDashboardBad(t *testing.T) {
	cat := fixture(t)
	const dash = `{"uid": "u", "title": "t",
  "templating": {"list": [
    {"name": "datasource", "type": "datasource", "query": "prometheus"},
    {"name": "instance", "type": "query", "query": {"query": "label_values(weightd_p2p_peers, nodename)"}}]},
  "panels": [{"id": 1, "type": "row", "title": "r", "panels": [
    {"id": 2, "type": "timeseries", "title": "typo", "datasource": {"type": "prometheus", "uid": "${datasource}"},
     "targets": [{"expr": "sum(rate(weightd_p2p_recieved_bytes_total[$__rate_interval]))", "datasource": {"type": "prometheus", "uid": "${datasource}"}}]},
    {"id": 2, "type": "timeseries", "title": "fixed datasource", "datasource": {"type": "prometheus", "uid": "prom"},
     "targets": [{"expr": "weightd_p2p_peers{instance=~\"$node\"}", "datasource": {"type": "prometheus", "uid": "prom"}}]}]}]}`
	_, err := checkDashboard(cat, []byte(dash))
	if err == nil {
		t.Fatal("a bad dashboard passed")
	}
	for _, want := range []string{
		"variable instance: no metric weightd_p2p_peers with the label nodename",
		`panel "typo": in "sum(rate(weightd_p2p_recieved_bytes_total[$__rate_interval]))"`,
		"weightd defines no such metric",
		"panel id 2 twice",
		`panel "fixed datasource": datasource`,
		"undefined variable $node",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}

func TestRulesBad(t *testing.T) {
	cat := fixture(t)
	const rules = `apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata: {name: x}
spec:
  groups:
    - name: g
      rules:
        - alert: WeightdPeersGone
          expr: weightd_p2p_peer == 0
          labels: {severity: page}
          annotations:
            summary: "{{ $labels.instance "
        - alert: WeightdPeersGone
          expr: weightd_p2p_peers == 0
          for: 10m
          labels: {severity: warning}
          annotations: {summary: s, description: d}
`
	_, err := checkRules(cat, []byte(rules))
	if err == nil {
		t.Fatal("bad rules passed")
	}
	for _, want := range []string{
		"weightd_p2p_peer: weightd defines no such metric",
		`for "" is not a positive duration`,
		`severity "page"`,
		"alert WeightdPeersGone: summary:",
		"has no description annotation",
		"alert WeightdPeersGone twice",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%v", want, err)
		}
	}
}
