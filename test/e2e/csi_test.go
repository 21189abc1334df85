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
	"k8s.io/apimachinery/pkg/api/resource"
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
	commit := c.hub.AddRepo("org/csi-model", files).Resolve("main")
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
	// The branch was resolved once, at publish: the pod names the commit.
	require.Equal(t, "hf://org/csi-model@"+commit, p.Annotations["volumes.weightd.io/model"], "the pod's annotations: %v", p.Annotations)
	c.waitEvent(t, ctx, restrictedNS, pod.Name, "ModelVolumeReady", "volume model: hf://org/csi-model@main resolved to hf://org/csi-model@"+commit)
	c.deletePodIn(t, ctx, restrictedNS, pod.Name)
	return true
}

// waitEvent waits for an Event on object name with reason whose message
// starts with prefix.
func (c *cluster) waitEvent(t *testing.T, ctx context.Context, ns, name, reason, prefix string) {
	t.Helper()
	var messages []string
	require.Eventually(t, func() bool {
		events, err := c.client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{
			FieldSelector: fields.Set{"involvedObject.name": name, "reason": reason}.AsSelector().String(),
		})
		require.NoError(t, err)
		messages = messages[:0]
		for _, e := range events.Items {
			messages = append(messages, e.Message)
		}
		return slices.ContainsFunc(messages, func(m string) bool { return strings.HasPrefix(m, prefix) })
	}, time.Minute, 250*time.Millisecond, "no %s Event on %s/%s starting %q among %q", reason, ns, name, prefix, messages)
}

// csiPersistent mounts csiExamplePod's model through a static
// PersistentVolume and its claim in two pods at once: each pod has its own
// mount and the agent a record of each; deleting one pod leaves the other's
// mount, and deleting both releases everything.
func (c *cluster) csiPersistent(t *testing.T, ctx context.Context, sleeper string) {
	const pvName, claim = "csi-model", "model"
	yes := true
	_, err := c.client.CoreV1().PersistentVolumes().Create(ctx, &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:         corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadOnlyMany},
			StorageClassName: "",
			ClaimRef:         &corev1.ObjectReference{Namespace: restrictedNS, Name: claim},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: "models.weightd.io", VolumeHandle: pvName, ReadOnly: true,
				VolumeAttributes: map[string]string{"model": "hf://org/csi-model@main"},
			}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	empty := ""
	_, err = c.client.CoreV1().PersistentVolumeClaims(restrictedNS).Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claim},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadOnlyMany},
			StorageClassName: &empty, VolumeName: pvName,
			Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)

	image := c.push(t, ctx, "sleeper", "v1", mustImage(t, sleeper, "/sleeper"))
	var targets []string
	for _, name := range []string{"pv-a", "pv-b"} {
		c.createRestrictedWith(t, ctx, name, image, corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim, ReadOnly: yes}})
	}
	for _, name := range []string{"pv-a", "pv-b"} {
		p := c.waitPod(t, ctx, restrictedNS, name, 2*time.Minute, func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
		// A persistent volume is mounted under the volume's own name.
		target := filepath.Join(c.node.KubeletDir, "pods", string(p.UID), "volumes", "kubernetes.io~csi", pvName, "mount")
		require.True(t, isMount(t, target), "pod %s's volume %s is not a mount", name, target)
		_, err := os.Stat(filepath.Join(target, "model.safetensors"))
		require.NoError(t, err)
		targets = append(targets, target)
	}
	require.Len(t, c.csiRecords(), 2, "a record per pod of the one volume")
	c.deletePodIn(t, ctx, restrictedNS, "pv-a")
	// The plugin drops a pod's record after its unmount: wait for both.
	require.Eventually(t, func() bool { return !isMount(t, targets[0]) && len(c.csiRecords()) == 1 }, time.Minute, 250*time.Millisecond,
		"after pv-a's deletion: records %v", c.csiRecords())
	require.True(t, isMount(t, targets[1]), "the other pod's mount of the volume")
	_, err = os.ReadFile(filepath.Join(targets[1], "config.json"))
	require.NoError(t, err, "the other pod's tree")
	c.deletePodIn(t, ctx, restrictedNS, "pv-b")
	require.Eventually(t, func() bool { return !isMount(t, targets[1]) && len(c.csiRecords()) == 0 }, time.Minute, 250*time.Millisecond,
		"after the pods' deletion: records %v", c.csiRecords())
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
	if !volume {
		c.createRestrictedWith(t, ctx, name, image, corev1.VolumeSource{})
		return
	}
	yes := true
	c.createRestrictedWith(t, ctx, name, image, corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
		Driver: "models.weightd.io", ReadOnly: &yes, VolumeAttributes: map[string]string{"model": "hf://org/csi-model@main", "files": "*.safetensors,*.json,*.txt"},
	}})
}

// createRestrictedWith creates a pod in restrictedNS that runs image, with
// the volume source at /models (as volume "model") unless it is empty.
func (c *cluster) createRestrictedWith(t *testing.T, ctx context.Context, name, image string, model corev1.VolumeSource) {
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
	if model != (corev1.VolumeSource{}) {
		s.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "model", MountPath: "/models", ReadOnly: true}}
		s.Volumes = []corev1.Volume{{Name: "model", VolumeSource: model}}
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
