package kube

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

const examplePod = "../../deploy/examples/pod-with-model-hostpath.yaml"

// readExamplePod parses the example strictly: an unknown or misspelt field
// is an error.
func readExamplePod(t *testing.T) *corev1.Pod {
	t.Helper()
	b, err := os.ReadFile(examplePod)
	require.NoError(t, err)
	var pod corev1.Pod
	require.NoError(t, yaml.UnmarshalStrict(b, &pod))
	return &pod
}

// TestExamplePod keeps deploy/examples/pod-with-model-hostpath.yaml consistent: the
// annotation parses, the init container waits for the same model through the
// agent's socket, the affinity names that model's label, the server mounts
// the cache read-only.
func TestExamplePod(t *testing.T) {
	t.Parallel()
	pod := readExamplePod(t)
	assert.Equal(t, "Pod", pod.Kind)
	assert.Equal(t, "v1", pod.APIVersion)

	req, err := podrequest.Parse(pod.Annotations, nil)
	require.NoError(t, err)
	require.Len(t, req.Models, 1)
	ref := req.Models[0].String()

	pref := pod.Spec.Affinity.NodeAffinity.PreferredDuringSchedulingIgnoredDuringExecution
	require.Len(t, pref, 1)
	expr := pref[0].Preference.MatchExpressions[0]
	assert.Equal(t, nodestate.Label(ref), expr.Key, "the affinity's label is `weightd key %s`", ref)
	assert.Equal(t, corev1.NodeSelectorOpIn, expr.Operator)
	assert.Equal(t, []string{nodestate.LabelReady}, expr.Values)

	require.Len(t, pod.Spec.InitContainers, 1)
	gate := pod.Spec.InitContainers[0]
	for _, arg := range []string{"weightd", "fetch", "--wait", "--api=unix:///run/weightd/weightd.sock", ref} {
		assert.Contains(t, gate.Command, arg)
	}
	volumes := make(map[string]*corev1.HostPathVolumeSource)
	for _, v := range pod.Spec.Volumes {
		volumes[v.Name] = v.HostPath
	}
	hostPath := func(m corev1.VolumeMount) string {
		require.NotNil(t, volumes[m.Name], m.Name)
		return volumes[m.Name].Path
	}
	assert.True(t, slices.ContainsFunc(gate.VolumeMounts, func(m corev1.VolumeMount) bool {
		return m.MountPath == "/run/weightd" && hostPath(m) == "/run/weightd"
	}), "the agent's socket directory")
	server := pod.Spec.Containers[0]
	// The node's cache is under containerd's root (the chart's default);
	// models/ and blobs/ stay siblings in the pod, as the snapshots' links
	// are relative.
	for _, dir := range []string{"/var/lib/weightd/models", "/var/lib/weightd/blobs"} {
		assert.True(t, slices.ContainsFunc(server.VolumeMounts, func(m corev1.VolumeMount) bool {
			return m.MountPath == dir && hostPath(m) == "/var/lib/containerd/weightd/"+filepath.Base(dir) && m.ReadOnly
		}), "%s read-only, from the node's cache (model directories link into blobs/)", dir)
	}
}

// TestExamplePodAccepted has a real API server validate the example.
func TestExamplePodAccepted(t *testing.T) {
	env := kubetest.NewT(t, kubetest.Config{})
	pod := readExamplePod(t)
	pod.Namespace = "default"
	_, err := env.Clientset().CoreV1().Pods("default").Create(t.Context(), pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	require.NoError(t, err)
}
