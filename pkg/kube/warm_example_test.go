package kube

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

const (
	exampleWarm = "../../deploy/examples/warm-server.yaml"
	daemonSet   = "../../deploy/daemonset/daemonset.yaml"
)

// readExampleWarm parses the warm server example strictly: its Deployment
// and its client Pod.
func readExampleWarm(t *testing.T) (*appsv1.Deployment, *corev1.Pod) {
	t.Helper()
	b, err := os.ReadFile(exampleWarm)
	require.NoError(t, err)
	docs := strings.Split(string(b), "\n---\n")
	require.Len(t, docs, 2)
	var d appsv1.Deployment
	require.NoError(t, yaml.UnmarshalStrict([]byte(docs[0]), &d))
	var p corev1.Pod
	require.NoError(t, yaml.UnmarshalStrict([]byte(docs[1]), &p))
	return &d, &p
}

// stageDir is the adapter stage directory the DaemonSet gives the agent.
func stageDir(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(daemonSet)
	require.NoError(t, err)
	var ds appsv1.DaemonSet
	require.NoError(t, yaml.UnmarshalStrict(b, &ds))
	agent := ds.Spec.Template.Spec.Containers[0]
	env := map[string]string{}
	for _, e := range agent.Env {
		env[e.Name] = e.Value
	}
	assert.Equal(t, "true", env["WEIGHTD_WARM"], "the warm pool is on")
	dir := env["WEIGHTD_WARM_STAGE_DIR"]
	require.NotEmpty(t, dir)
	// Inside the cache's mount (containerd's root, which holds the cache):
	// staging from the cache is a hard link.
	assert.True(t, slices.ContainsFunc(agent.VolumeMounts, func(m corev1.VolumeMount) bool {
		return strings.HasPrefix(dir, m.MountPath+"/") && m.Name == "containerd-root"
	}), "stage dir %s under the cache mount", dir)
	return dir
}

// TestExampleWarmServer keeps deploy/examples/warm-server.yaml consistent:
// the server's annotations parse and match vLLM's flags, the server mounts
// the DaemonSet's stage directory read-only at the same path, and the
// client asks for an adapter on the server's base, on nodes labelled warm
// for it.
func TestExampleWarmServer(t *testing.T) {
	t.Parallel()
	d, client := readExampleWarm(t)
	tmpl := d.Spec.Template
	assert.True(t, podrequest.IsWarmServer(tmpl.Labels))
	srv, err := podrequest.ParseWarmServer(tmpl.Annotations)
	require.NoError(t, err)
	assert.Equal(t, engine.VLLM, srv.Runtime)
	req, err := podrequest.Parse(tmpl.Annotations, nil)
	require.NoError(t, err)
	require.Len(t, req.Models, 1)
	assert.Equal(t, srv.Base.String(), req.Models[0].String(), "the base is prefetched")

	vllm := tmpl.Spec.Containers[0]
	for _, arg := range []string{
		"--enable-lora", "--max-loras=" + strconv.Itoa(srv.Slots), "--max-lora-rank=" + strconv.Itoa(srv.MaxRank),
		"--port=" + strconv.Itoa(srv.Port),
	} {
		assert.Contains(t, vllm.Args, arg)
	}
	assert.Equal(t, int32(srv.Port), vllm.Ports[0].ContainerPort)
	assert.Contains(t, vllm.Env, corev1.EnvVar{Name: "VLLM_ALLOW_RUNTIME_LORA_UPDATING", Value: "True"})
	gate := tmpl.Spec.InitContainers[0]
	assert.Contains(t, gate.Command, srv.Base.String())

	dir := stageDir(t)
	volumes := make(map[string]*corev1.HostPathVolumeSource)
	for _, v := range tmpl.Spec.Volumes {
		volumes[v.Name] = v.HostPath
	}
	assert.True(t, slices.ContainsFunc(vllm.VolumeMounts, func(m corev1.VolumeMount) bool {
		return m.MountPath == dir && m.ReadOnly && volumes[m.Name] != nil && volumes[m.Name].Path == dir
	}), "the stage dir %s read-only at the node's path", dir)

	areq, ok, err := podrequest.ParseAdapterRequest(client.Annotations)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, srv.Base.String(), areq.Base.String())
	terms := client.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	require.Len(t, terms, 1)
	expr := terms[0].MatchExpressions[0]
	assert.Equal(t, nodestate.WarmLabel(srv.Base.String()), expr.Key, "the affinity's label is warm.weightd.io/ + `weightd key %s`", srv.Base)
	assert.Equal(t, []string{nodestate.LabelReady}, expr.Values)
}

// testExampleWarmAccepted has a real API server validate the example.
func testExampleWarmAccepted(t *testing.T, env *kubetest.Env) {
	d, client := readExampleWarm(t)
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	_, err := env.Clientset().AppsV1().Deployments("default").Create(t.Context(), d, dry)
	require.NoError(t, err)
	_, err = env.Clientset().CoreV1().Pods("default").Create(t.Context(), client, dry)
	require.NoError(t, err)
}
