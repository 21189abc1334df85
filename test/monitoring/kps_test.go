package monitoring

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/test/deploy/manifests"
)

// kubePrometheusStack is what a default install of the kube-prometheus-stack
// chart (prometheus-community/helm-charts, 88.5.3) selects, installed as
// release "kube-prometheus-stack", the name the chart's monitoring.release
// assumes. With *SelectorNilUsesHelmValues true (the default) its
// Prometheus selects PodMonitors, ServiceMonitors and PrometheusRules
// labelled release=<its release> (templates/prometheus/prometheus.yaml), in
// every namespace (the *NamespaceSelectors are {}); its Grafana's dashboard
// sidecar loads ConfigMaps labelled grafana_dashboard="1" in every namespace
// (grafana.sidecar.dashboards: label, labelValue, searchNamespace: ALL).
var kubePrometheusStack = struct {
	monitors, rules, dashboards labels.Selector
}{
	monitors:   labels.SelectorFromSet(labels.Set{"release": "kube-prometheus-stack"}),
	rules:      labels.SelectorFromSet(labels.Set{"release": "kube-prometheus-stack"}),
	dashboards: labels.SelectorFromSet(labels.Set{"grafana_dashboard": "1"}),
}

// TestKubePrometheusStackSelects renders the chart with its monitoring on
// and otherwise default values, and checks that a default
// kube-prometheus-stack install picks up every monitor, the rules and the
// dashboards, and that both monitors add the node label the dashboard and
// alerts group by. It skips where helm is not built, except under CI=true.
func TestKubePrometheusStackSelects(t *testing.T) {
	helm := services.RequireHelm(t)
	dir := t.TempDir()
	cmd := exec.CommandContext(t.Context(), helm, "template", manifests.Release, filepath.Join(root, manifests.Chart),
		"--namespace", manifests.Namespace,
		"--set", "monitoring.podMonitor.enabled=true",
		"--set", "monitoring.serviceMonitor.enabled=true",
		"--set", "monitoring.prometheusRule.enabled=true",
		"--set", "monitoring.dashboards.enabled=true")
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+dir+"/cache", "HELM_CONFIG_HOME="+dir+"/config", "HELM_DATA_HOME="+dir+"/data")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, stderr.Bytes())
	}
	docs, err := manifests.Split(out)
	if err != nil {
		t.Fatal(err)
	}
	picked := map[string]int{}
	for _, d := range docs {
		var obj struct {
			Kind     string
			Metadata struct {
				Name   string
				Labels map[string]string
			}
			Spec struct {
				PodMetricsEndpoints []struct{ Relabelings []relabeling } `json:"podMetricsEndpoints"`
				Endpoints           []struct{ Relabelings []relabeling } `json:"endpoints"`
			}
		}
		if err := yaml.Unmarshal([]byte(d.Body), &obj); err != nil {
			t.Fatalf("%s: %v", d.Source, err)
		}
		var sel labels.Selector
		switch obj.Kind {
		case "PodMonitor", "ServiceMonitor":
			sel = kubePrometheusStack.monitors
			for _, e := range append(obj.Spec.PodMetricsEndpoints, obj.Spec.Endpoints...) {
				if !slices.ContainsFunc(e.Relabelings, func(r relabeling) bool {
					return slices.Equal(r.SourceLabels, []string{"__meta_kubernetes_pod_node_name"}) && r.TargetLabel == "node" && (r.Action == "" || r.Action == "replace")
				}) {
					t.Errorf("%s %s: an endpoint sets no node label from __meta_kubernetes_pod_node_name (relabelings %+v)", obj.Kind, obj.Metadata.Name, e.Relabelings)
				}
			}
		case "PrometheusRule":
			sel = kubePrometheusStack.rules
		case "ConfigMap":
			if obj.Metadata.Labels["grafana_dashboard"] == "" {
				continue
			}
			sel = kubePrometheusStack.dashboards
		default:
			continue
		}
		if !sel.Matches(labels.Set(obj.Metadata.Labels)) {
			t.Errorf("%s %s labelled %v: a default kube-prometheus-stack selects %s", obj.Kind, obj.Metadata.Name, obj.Metadata.Labels, sel)
			continue
		}
		picked[obj.Kind]++
	}
	for _, k := range []string{"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap"} {
		if picked[k] != 1 {
			t.Errorf("%d %s picked up, want 1 (picked %v)", picked[k], k, picked)
		}
	}
}
