package deploy_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/ref"
)

const examples = repoRoot + "/deploy/examples"

// readPod parses an example pod strictly: an unknown or misspelt field is
// an error.
func readPod(t *testing.T, name string) *corev1.Pod {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(examples, name))
	if err != nil {
		t.Fatal(err)
	}
	var pod corev1.Pod
	if err := yaml.UnmarshalStrict(b, &pod); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return &pod
}

// TestExampleCSIPod keeps deploy/examples/pod-with-model.yaml, the CSI
// form, consistent: one read-only volume of the driver the chart installs,
// whose model is a reference the agent parses, mounted read-only where
// HF_HUB_CACHE points into; the affinity names that model's label.
func TestExampleCSIPod(t *testing.T) {
	t.Parallel()
	pod := readPod(t, "pod-with-model.yaml")
	if len(pod.Spec.Volumes) != 1 || pod.Spec.Volumes[0].CSI == nil {
		t.Fatalf("volumes %+v: want one csi volume", pod.Spec.Volumes)
	}
	v := pod.Spec.Volumes[0]
	r := render(t, "csi.enabled=true")
	if _, ok := r.csiDrivers[v.CSI.Driver]; !ok || v.CSI.ReadOnly == nil || !*v.CSI.ReadOnly {
		t.Errorf("csi volume %+v: want a read-only volume of the chart's driver (%v)", v.CSI, r.csiDrivers)
	}
	parsed, err := ref.Parse(v.CSI.VolumeAttributes["model"])
	if err != nil {
		t.Fatalf("the model attribute: %v", err)
	}
	expr := pod.Spec.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].Preference.MatchExpressions[0]
	if expr.Key != nodestate.Label(parsed.String()) || expr.Values[0] != nodestate.LabelReady {
		t.Errorf("affinity on %s=%v, want `weightd key %s`'s label %s", expr.Key, expr.Values, parsed, nodestate.Label(parsed.String()))
	}
	c := pod.Spec.Containers[0]
	var mount *corev1.VolumeMount
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].Name == v.Name {
			mount = &c.VolumeMounts[i]
		}
	}
	if mount == nil || !mount.ReadOnly {
		t.Fatalf("the server mounts the model as %+v: want it read-only", mount)
	}
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	if env["HF_HUB_CACHE"] != mount.MountPath+"/hub" || env["HF_HUB_OFFLINE"] != "1" {
		t.Errorf("env %v: want HF_HUB_CACHE=%s/hub, the volume's hub cache, offline", env, mount.MountPath)
	}
}

// TestExamplesPodSecurity: a real API server's Pod Security admission
// admits the CSI example in a namespace that enforces "restricted", and
// refuses the hostPath fallback there (host paths, a root init container),
// which a namespace at "privileged" admits.
func TestExamplesPodSecurity(t *testing.T) {
	t.Parallel()
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	cs := env.Clientset()
	for ns, level := range map[string]string{"restricted": "restricted", "privileged": "privileged"} {
		_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
			Name:   ns,
			Labels: map[string]string{"pod-security.kubernetes.io/enforce": level, "pod-security.kubernetes.io/enforce-version": "latest"},
		}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	create := func(ns, file string) error {
		_, err := cs.CoreV1().Pods(ns).Create(ctx, readPod(t, file), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	if err := create("restricted", "pod-with-model.yaml"); err != nil {
		t.Errorf("the CSI example under restricted: %v", err)
	}
	err := create("restricted", "pod-with-model-hostpath.yaml")
	if err == nil || !strings.Contains(err.Error(), `violates PodSecurity "restricted:latest"`) ||
		!strings.Contains(err.Error(), `use restricted volume type "hostPath"`) || !strings.Contains(err.Error(), `container "weights" must not set runAsUser=0`) {
		t.Errorf("the hostPath example under restricted: %v, want refused for its host paths and its root init container", err)
	}
	if err := create("privileged", "pod-with-model-hostpath.yaml"); err != nil {
		t.Errorf("the hostPath example under privileged: %v", err)
	}
}
