package main

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/pkg/nodestate"
)

func TestKeyCommand(t *testing.T) {
	code, out, errOut := runCLI(t, "key", "hf://meta-llama/Llama-3.1-8B-Instruct@main")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	label := nodestate.Label("hf://meta-llama/Llama-3.1-8B-Instruct@main")
	for _, want := range []string{"key: " + nodestate.Key("hf://meta-llama/Llama-3.1-8B-Instruct@main"), "label: " + label + "=ready", "- key: " + label} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	var parsed struct {
		Key      string          `json:"key"`
		Label    string          `json:"label"`
		Affinity corev1.Affinity `json:"affinity"`
	}
	if err := yaml.UnmarshalStrict([]byte(out), &parsed); err != nil {
		t.Fatalf("output is not YAML of a key, a label and an affinity: %v", err)
	}
	if terms := parsed.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution; len(terms) != 1 ||
		terms[0].Preference.MatchExpressions[0].Key != label || terms[0].Preference.MatchExpressions[0].Values[0] != "ready" {
		t.Errorf("affinity %+v", parsed.Affinity)
	}
	code, out, _ = runCLI(t, "key", "--image", "nginx")
	if code != 0 || !strings.Contains(out, nodestate.Key("oci://docker.io/library/nginx:latest")) {
		t.Errorf("exit %d:\n%s", code, out)
	}
	if code, _, _ := runCLI(t, "key", "ftp://nope"); code == 0 {
		t.Error("a bad reference is an error")
	}
}
