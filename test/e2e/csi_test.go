package e2e

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/hubtest"
)

// restrictedNS is a namespace that enforces Pod Security "restricted",
// where the CSI form of the example must run.
const restrictedNS = "restricted"

// csiExamplePod runs deploy/examples/pod-with-model.yaml, the CSI form, as
// written but for the model (the test hub's) and the container (a reader
// of the model by name, offline, through the volume's hub cache, in place
// of the GPU server), in a namespace that enforces Pod Security
// "restricted". The model is not on the node, and the hub holds back the
// weights' second half: the kubelet's publishes are answered with the
// fetch's progress, which the pod's events show; once the hub lets the
// rest go, the pod runs with the model mounted. It returns whether the reader
// found every byte.
func (c *cluster) csiExamplePod(t *testing.T, ctx context.Context, reader string) bool {
	_, err := c.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name:   restrictedNS,
		Labels: map[string]string{"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"},
	}}, metav1.CreateOptions{})
	require.NoError(t, err)

	// The weights' second half waits until the pod's events have shown the
	// fetch in progress.
	const size = 48 << 20
	g := newGate(size/2, hubtest.Generated(size, 11))
	defer g.open()
	files := map[string]hubtest.Content{
		"config.json":              hubtest.String(`{"model_type":"csi"}`),
		"model.safetensors":        g,
		"tokenizer/tokenizer.json": hubtest.Generated(1<<20, 12),
	}
	c.hub.AddRepo("org/csi-model", files)
	g.arm() // the hub read the file whole to hash it
	var expect []string
	for p := range files {
		expect = append(expect, p+"="+c.hub.SHA256("org/csi-model", "main", p))
	}

	b, err := os.ReadFile(filepath.Join(c.root, "deploy", "examples", "pod-with-model.yaml"))
	require.NoError(t, err)
	var pod corev1.Pod
	require.NoError(t, yaml.UnmarshalStrict(b, &pod))
	pod.Namespace = restrictedNS
	attrs := pod.Spec.Volumes[0].CSI.VolumeAttributes
	require.Equal(t, "hf://Qwen/Qwen2.5-0.5B-Instruct@main", attrs["model"])
	attrs["model"] = "hf://org/csi-model@main"
	// The example's globs, which the test's files all match.
	require.Equal(t, "*.safetensors,*.json,*.txt", attrs["files"])
	server := &pod.Spec.Containers[0]
	server.Image = c.push(t, ctx, "reader", "v1", mustImage(t, reader, "/reader"))
	server.Args, server.Ports, server.ReadinessProbe = []string{"org/csi-model", "main"}, nil, nil
	server.Resources = corev1.ResourceRequirements{} // no GPU here
	server.Env = append(server.Env, corev1.EnvVar{Name: "EXPECT", Value: strings.Join(expect, ",")})
	pod.Spec.RestartPolicy = corev1.RestartPolicyNever

	_, err = c.client.CoreV1().Pods(restrictedNS).Create(ctx, &pod, metav1.CreateOptions{})
	require.NoError(t, err, "the API server's Pod Security admission refused the CSI example")

	// kubectl describe pod: the plugin's progress while the model is
	// fetched, as the kubelet reports a publish it will retry.
	var messages []string
	require.Eventually(t, func() bool {
		events, err := c.client.CoreV1().Events(restrictedNS).List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", pod.Name).String(),
		})
		require.NoError(t, err)
		messages = messages[:0]
		for _, e := range events.Items {
			messages = append(messages, e.Reason+": "+e.Message)
		}
		return slices.ContainsFunc(messages, func(m string) bool {
			return strings.HasPrefix(m, "FailedMount: ") && strings.Contains(m, "Unavailable") && strings.Contains(m, "hf://org/csi-model@main: fetching")
		})
	}, 2*time.Minute, 250*time.Millisecond, "no event of the fetch's progress among %q", messages)
	t.Logf("the pod's events while the model is fetched: %q", messages)
	require.True(t, g.reached(), "the progress was shown before the download reached the held-back half")
	g.open()

	p := c.waitPod(t, ctx, restrictedNS, pod.Name, 3*time.Minute, func(p *corev1.Pod) bool {
		return p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
	})
	term := p.Status.ContainerStatuses[0].State.Terminated
	require.NotNil(t, term)
	require.Equal(t, corev1.PodSucceeded, p.Status.Phase, "the reader: %s", term.Message)
	require.Equal(t, "ok", term.Message)
	c.deletePodIn(t, ctx, restrictedNS, pod.Name)
	return true
}

// csiRunning starts, in turn, a pod with the CSI volume of the model that
// csiExamplePod left on the node and the same pod without it, three times
// each, and returns the median seconds from creation to Running of each.
// While a pod with the volume runs, its target is a mount and the agent
// holds a record (its pin) of the volume; once the pod is deleted, the
// target is unmounted and the record gone.
func (c *cluster) csiRunning(t *testing.T, ctx context.Context, sleeper string) (withVolume, without float64) {
	image := c.push(t, ctx, "sleeper", "v1", mustImage(t, sleeper, "/sleeper"))
	run := func(name string, volume bool) (float64, *corev1.Pod) {
		start := time.Now()
		c.createRestricted(t, ctx, name, image, volume)
		p := c.waitPod(t, ctx, restrictedNS, name, 2*time.Minute, func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
		return time.Since(start).Seconds(), p
	}
	records := c.csiRecords
	// The image pulled once, before anything is timed.
	run("warm-up", false)
	c.deletePodIn(t, ctx, restrictedNS, "warm-up")

	var with, plain []float64
	for i := range 3 {
		s, _ := run("plain-"+string(rune('a'+i)), false)
		plain = append(plain, s)
		s, p := run("volume-"+string(rune('a'+i)), true)
		with = append(with, s)
		target := c.csiTarget(p)
		require.True(t, isMount(t, target), "the volume's target %s is not a mount", target)
		require.Len(t, records(), 1, "the agent holds no record of the published volume")
		c.deletePodIn(t, ctx, restrictedNS, p.Name)
		c.deletePodIn(t, ctx, restrictedNS, "plain-"+string(rune('a'+i)))
		require.Eventually(t, func() bool { return !isMount(t, target) && len(records()) == 0 }, time.Minute, 250*time.Millisecond,
			"after the pod's deletion: target mounted %v, records %v", isMount(t, target), records())
	}
	slices.Sort(with)
	slices.Sort(plain)
	t.Logf("time to Running in %s: with the CSI volume of a cached model %.2f s (runs %v), without %.2f s (runs %v)", restrictedNS, with[1], with, plain[1], plain)
	return with[1], plain[1]
}

// createRestricted creates a pod in restrictedNS that runs image, with the
// CSI volume of csiExamplePod's model at /models when volume is set.
func (c *cluster) createRestricted(t *testing.T, ctx context.Context, name, image string, volume bool) {
	t.Helper()
	yes, no := true, false
	uid := int64(1000)
	s := corev1.PodSpec{
		SecurityContext: &corev1.PodSecurityContext{RunAsNonRoot: &yes, RunAsUser: &uid, SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}},
		Containers: []corev1.Container{{
			Name: "c", Image: image,
			SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: &no, Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}},
		}},
	}
	if volume {
		s.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "model", MountPath: "/models", ReadOnly: true}}
		s.Volumes = []corev1.Volume{{Name: "model", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
			Driver: "models.weightd.io", ReadOnly: &yes, VolumeAttributes: map[string]string{"model": "hf://org/csi-model@main", "files": "*.safetensors,*.json,*.txt"},
		}}}}
	}
	_, err := c.client.CoreV1().Pods(restrictedNS).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: s}, metav1.CreateOptions{})
	require.NoError(t, err)
}

// csiTarget is the host path where the kubelet has pod p's CSI volume
// mounted.
func (c *cluster) csiTarget(p *corev1.Pod) string {
	return filepath.Join(c.node.KubeletDir, "pods", string(p.UID), "volumes", "kubernetes.io~csi", "model", "mount")
}

// csiRecords lists the agent's records of published volumes, each the
// pin of its model's blobs.
func (c *cluster) csiRecords() []string {
	r, _ := filepath.Glob(filepath.Join(c.cacheRoot, "csi", "*.json"))
	return r
}

// csiAgentKilled kills the agent's process while a pod's volume is
// published, and asks for a second pod's volume while the agent is down:
// the first pod runs on with its mount and its record (the pin), and the
// second starts once the kubelet has restarted the agent and published
// the volume on a retry.
func (c *cluster) csiAgentKilled(t *testing.T, ctx context.Context, sleeper string) {
	image := c.push(t, ctx, "sleeper", "v1", mustImage(t, sleeper, "/sleeper"))
	c.createRestricted(t, ctx, "survivor", image, true)
	survivor := c.waitPod(t, ctx, restrictedNS, "survivor", 2*time.Minute, func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
	target := c.csiTarget(survivor)
	require.True(t, isMount(t, target))
	require.Len(t, c.csiRecords(), 1)

	agent := c.agentPod(t, ctx)
	restarts := agent.Status.ContainerStatuses[0].RestartCount
	require.NoError(t, syscall.Kill(agentPID(t, agent), syscall.SIGKILL))
	c.createRestricted(t, ctx, "during-restart", image, true)
	c.waitPod(t, ctx, namespace, agent.Name, 3*time.Minute, func(p *corev1.Pod) bool {
		return p.Status.ContainerStatuses[0].RestartCount > restarts && podReady(p)
	})
	c.waitPod(t, ctx, restrictedNS, "during-restart", 3*time.Minute, func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })

	p, err := c.client.CoreV1().Pods(restrictedNS).Get(ctx, "survivor", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, corev1.PodRunning, p.Status.Phase)
	require.Zero(t, p.Status.ContainerStatuses[0].RestartCount)
	require.True(t, isMount(t, target), "the survivor's volume was unmounted by the agent's restart")
	require.Len(t, c.csiRecords(), 2, "the agent's records after its restart")
	c.deletePodIn(t, ctx, restrictedNS, "survivor")
	c.deletePodIn(t, ctx, restrictedNS, "during-restart")
	require.Eventually(t, func() bool { return !isMount(t, target) && len(c.csiRecords()) == 0 }, time.Minute, 250*time.Millisecond,
		"after the pods' deletion: records %v", c.csiRecords())
}

// isMount says whether path is a mount point on the host.
func isMount(t *testing.T, path string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	require.NoError(t, err)
	for line := range strings.SplitSeq(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}
