package e2e

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/internal/kubenode"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

// readerSource reads a model the way the Hugging Face libraries do with
// HF_HUB_OFFLINE=1: by name and revision, through refs/<revision> to the
// commit's snapshot under HF_HUB_CACHE, then each file through its link.
// It checks each file's SHA-256 against EXPECT (path=hex,...) and exits
// non-zero, saying why in its termination message, on any difference.
const readerSource = `package main

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

func main() {
	if err := run(); err != nil {
		os.WriteFile("/dev/termination-log", []byte(err.Error()), 0o644)
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.WriteFile("/dev/termination-log", []byte("ok"), 0o644)
}

func run() error {
	if os.Getenv("HF_HUB_OFFLINE") != "1" {
		return fmt.Errorf("HF_HUB_OFFLINE is not 1")
	}
	repo, rev := os.Args[1], os.Args[2]
	dir := filepath.Join(os.Getenv("HF_HUB_CACHE"), "models--"+strings.ReplaceAll(repo, "/", "--"))
	commit, err := os.ReadFile(filepath.Join(dir, "refs", rev))
	if err != nil {
		return err
	}
	for _, kv := range strings.Split(os.Getenv("EXPECT"), ",") {
		path, want, _ := strings.Cut(kv, "=")
		f, err := os.Open(filepath.Join(dir, "snapshots", string(commit), path))
		if err != nil {
			return err
		}
		h := sha256.New()
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return err
		}
		if got := hex.EncodeToString(h.Sum(nil)); got != want {
			return fmt.Errorf("%s: sha256 %s, want %s", path, got, want)
		}
	}
	return nil
}
`

// benchLine is the JSON line the test prints for dashboards (issue 19).
type benchLine struct {
	Bench          string  `json:"bench"`
	Nodes          int     `json:"nodes"`
	ImageViaMirror bool    `json:"image_via_mirror"`
	ModelByName    bool    `json:"model_by_name"`
	PodReadyS      float64 `json:"pod_ready_s"`
	ImagePullS     float64 `json:"image_pull_s"`
	// The CSI volume: the example read its model by name, and the median
	// time to Running of a pod with the volume of a cached model and of
	// the same pod without it, alternating in one run.
	CSIModelByName   bool    `json:"csi_model_by_name"`
	CSIPodRunningS   float64 `json:"csi_pod_running_s"`
	PlainPodRunningS float64 `json:"plain_pod_running_s"`
	// A pod with the CSI volume of a model that only a peer holds: the
	// model's size, the peer's link, the model's time on it, and the pod's
	// creation to Running.
	CSIPeerModelBytes  int64   `json:"csi_peer_model_bytes"`
	CSIPeerLinkMbit    int     `json:"csi_peer_link_mbit"`
	CSIPeerSOverB      float64 `json:"csi_peer_s_over_b"`
	CSIPeerPodRunningS float64 `json:"csi_peer_pod_running_s"`
}

// TestKubelet installs weightd with its chart on a real node and checks,
// each in its own subtest, what users see. The subtests share the node and
// run in order: later ones restart the agent.
func TestKubelet(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Minute)
	defer cancel()
	c := newCluster(t, ctx)
	line := benchLine{Bench: "kubelet-e2e", Nodes: 1}

	sleeper, err := kubenode.BuildStatic(ctx, filepath.Join(c.dir, "sleeper"), "sleeper", kubenode.PauseSource)
	require.NoError(t, err)
	reader, err := kubenode.BuildStatic(ctx, filepath.Join(c.dir, "reader"), "reader", readerSource)
	require.NoError(t, err)

	t.Run("ImagePulledThroughTheMirror", func(t *testing.T) {
		line.ImageViaMirror, line.ImagePullS = c.imageThroughMirror(t, ctx, sleeper)
	})
	t.Run("PrefetchedImageIsLinked", func(t *testing.T) {
		c.prefetchLinks(t, ctx, sleeper)
	})
	t.Run("ModelPodReadsByName", func(t *testing.T) {
		line.ModelByName, line.PodReadyS = c.modelPod(t, ctx, reader)
	})
	t.Run("StatusLabelAndPolicy", func(t *testing.T) {
		c.statusLabelAndPolicy(t, ctx, sleeper)
	})
	t.Run("CSIVolumeUnderRestricted", func(t *testing.T) {
		line.CSIModelByName = c.csiExamplePod(t, ctx, reader)
		line.CSIPodRunningS, line.PlainPodRunningS = c.csiRunning(t, ctx, sleeper)
	})
	t.Run("CSIAgentKilled", func(t *testing.T) {
		c.csiAgentKilled(t, ctx, sleeper)
	})
	t.Run("CSIPersistentVolume", func(t *testing.T) {
		c.csiPersistent(t, ctx, sleeper)
	})
	t.Run("CSIVolumeFromPeer", func(t *testing.T) {
		f := c.csiFromPeer(t, ctx, sleeper)
		line.CSIPeerModelBytes, line.CSIPeerLinkMbit, line.CSIPeerSOverB, line.CSIPeerPodRunningS = f.modelBytes, f.linkMbit, f.sOverB, f.runningS
	})
	t.Run("RollingUpdateKeepsCacheAndDownloads", func(t *testing.T) {
		c.survives(t, ctx, sleeper, "org/rolled", 7, func() {
			c.helmRun(t, ctx, "upgrade", release, filepath.Join(c.root, "charts", "weightd"), "--namespace", namespace, "-f", c.values, "--set", "image.tag="+c.tags[1])
			c.waitAgentReady(t, ctx, c.tags[1])
		})
	})
	t.Run("AgentKilledComesBack", func(t *testing.T) {
		c.survives(t, ctx, sleeper, "org/killed", 8, func() {
			// Deleted, as `kubectl delete pod` does: the DaemonSet makes a
			// new pod.
			old := c.agentPod(t, ctx)
			require.NoError(t, c.client.CoreV1().Pods(namespace).Delete(ctx, old.Name, metav1.DeleteOptions{}))
			p := c.waitAgentReady(t, ctx, c.tags[1])
			require.NotEqual(t, old.UID, p.UID)
			// Killed as the OOM killer kills: SIGKILL to the agent's
			// process; the kubelet restarts the container in place.
			restarts := p.Status.ContainerStatuses[0].RestartCount
			require.NoError(t, syscall.Kill(agentPID(t, p), syscall.SIGKILL))
			c.waitPod(t, ctx, namespace, p.Name, 3*time.Minute, func(p *corev1.Pod) bool {
				return p.Status.ContainerStatuses[0].RestartCount > restarts && podReady(p)
			})
		})
	})
	t.Run("UninstallRestoresHosts", func(t *testing.T) {
		hosts := filepath.Join(c.node.Containerd.HostsDir, c.registry.Addr, "hosts.toml")
		require.FileExists(t, hosts)
		// The chart's post-delete hook runs restore-hosts on every node
		// and waits for them all; the node had no hosts.toml of its own
		// for the registry, so weightd's goes.
		c.helmRun(t, ctx, "uninstall", release, "--namespace", namespace, "--timeout", "3m")
		require.NoFileExists(t, hosts)
		// Pulls go straight to the registry again.
		before := c.registry.BytesServed()
		c.runPod(t, ctx, "after-uninstall", c.push(t, ctx, "sleeper", "v2", mustImage(t, sleeper, "/sleeper-after")))
		require.Greater(t, c.registry.BytesServed(), before)
	})
	if !t.Failed() {
		b, err := json.Marshal(line)
		require.NoError(t, err)
		fmt.Println(string(b))
	}
}

// imageThroughMirror has the kubelet pull a pod's image from the registry,
// through the agent's mirror (containerd's hosts.toml, written by the
// agent), then has it pull the same layers under a new tag once containerd
// no longer holds them: the second pull's layers come from weightd's
// cache, not the registry. It returns whether the mirror served the first
// pull and how long the first pod took from creation to running.
func (c *cluster) imageThroughMirror(t *testing.T, ctx context.Context, sleeper string) (bool, float64) {
	hosts, err := os.ReadFile(filepath.Join(c.node.Containerd.HostsDir, c.registry.Addr, "hosts.toml"))
	require.NoError(t, err, "the agent wrote no hosts.toml for the registry")
	require.Contains(t, string(hosts), "Written by weightd")
	// The agent asked containerd whether it reads that directory.
	require.Equal(t, 1.0, c.metric(t, `weightd_mirror_containerd_config_path{state="configured"}`))

	data := make([]byte, 16<<20)
	_, _ = rand.Read(data)
	layer, err := kubenode.FilesLayer(map[string][]byte{"/data/weights.bin": data}, 0o644)
	require.NoError(t, err)
	img, err := kubenode.ProgramImage(sleeper, "/sleeper", layer)
	require.NoError(t, err)
	size := imageSize(t, img)
	ref1 := c.push(t, ctx, "app", "v1", img)
	// The next version of the image: the same data layer over a new first
	// layer, so that containerd, which skips the layers of a chain it has
	// unpacked, must fetch the data layer again.
	img2, err := kubenode.ProgramImage(sleeper, "/sleeper-v2", layer)
	require.NoError(t, err)
	ref2 := c.push(t, ctx, "app", "v2", img2)

	mirrored := c.metric(t, "weightd_mirror_bytes_total")
	before := c.registry.BytesServed()
	start := time.Now()
	c.runPod(t, ctx, "pull-1", ref1)
	pull := time.Since(start).Seconds()
	viaMirror := c.metric(t, "weightd_mirror_bytes_total") - mirrored
	fromRegistry := c.registry.BytesServed() - before
	t.Logf("first pull: %d bytes from the registry, %.0f through the mirror, image %d bytes, pod running after %.1f s", fromRegistry, viaMirror, size, pull)
	require.GreaterOrEqual(t, viaMirror, float64(len(data)), "the kubelet's pull did not go through the mirror")
	require.Less(t, fromRegistry, 2*size, "the registry sent more than one copy")

	// containerd forgets the image and its layers; weightd's cache keeps them.
	c.deletePod(t, ctx, "pull-1")
	require.NoError(t, services.RemoveImageCRI(ctx, c.node.Containerd.Address, ref1))
	require.Eventually(t, func() bool {
		out, err := c.node.Containerd.Ctr(ctx, "content", "ls", "-q")
		return err == nil && !strings.Contains(string(out), layerDigest(t, layer))
	}, time.Minute, 250*time.Millisecond, "containerd kept the layer")

	before, mirrored = c.registry.BytesServed(), c.metric(t, "weightd_mirror_bytes_total")
	c.runPod(t, ctx, "pull-2", ref2)
	fromRegistry = c.registry.BytesServed() - before
	viaMirror = c.metric(t, "weightd_mirror_bytes_total") - mirrored
	t.Logf("second pull, a new tag sharing the data layer: %d bytes from the registry, %.0f through the mirror", fromRegistry, viaMirror)
	require.GreaterOrEqual(t, viaMirror, float64(len(data)))
	require.Less(t, fromRegistry, int64(len(data))/4, "the second pull's data layer came from the registry, not the cache")
	c.deletePod(t, ctx, "pull-2")
	return viaMirror >= float64(len(data)), pull
}

// prefetchLinks has the agent prefetch an image that a pod's annotation
// names into the node's containerd, with the chart's default layout: the
// image's layers in containerd's content store are the cache's own files,
// hard-linked (one inode), not copies.
func (c *cluster) prefetchLinks(t *testing.T, ctx context.Context, sleeper string) {
	data := make([]byte, 8<<20)
	_, _ = rand.Read(data)
	layer, err := kubenode.FilesLayer(map[string][]byte{"/data/linked.bin": data}, 0o644)
	require.NoError(t, err)
	img, err := kubenode.ProgramImage(sleeper, "/sleeper", layer)
	require.NoError(t, err)
	ref := c.push(t, ctx, "linked", "v1", img)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "prefetch-image", Annotations: map[string]string{podrequest.Models: "oci://" + ref}},
		// Not the prefetched image itself: the kubelet's own pull of it
		// through the CRI would race the agent's import and write the
		// layer first.
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: kubenode.PauseImage, ImagePullPolicy: corev1.PullNever}}},
	}
	_, err = c.client.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	c.waitPod(t, ctx, metav1.NamespaceDefault, pod.Name, 3*time.Minute, func(p *corev1.Pod) bool {
		return p.Annotations[podrequest.Status] == "ready"
	})
	hex := strings.TrimPrefix(layerDigest(t, layer), "sha256:")
	inContainerd, err := os.Stat(filepath.Join(c.node.Containerd.Root, "io.containerd.content.v1.content", "blobs", "sha256", hex))
	require.NoError(t, err, "the layer is not in containerd's content store")
	inCache, err := os.Stat(filepath.Join(c.cacheRoot, "blobs", "sha256", hex))
	require.NoError(t, err, "the layer is not in the cache")
	require.True(t, os.SameFile(inContainerd, inCache), "containerd's copy of the layer is not the cache's file")
	c.deletePod(t, ctx, pod.Name)
}

// modelPod runs deploy/examples/pod-with-model-hostpath.yaml as written, but for
// the model of the test's hub, this image registry and the node's cache
// path, and with a container that reads the model by name offline in
// place of the GPU server. It returns whether the reader found every byte
// and how long the pod took from creation to its reader's success.
func (c *cluster) modelPod(t *testing.T, ctx context.Context, reader string) (bool, float64) {
	files := map[string]hubtest.Content{
		"config.json":                  hubtest.String(`{"model_type":"e2e"}`),
		"model.safetensors":            hubtest.Generated(24<<20, 1),
		"tokenizer/tokenizer.json":     hubtest.Generated(1<<20, 2),
		"generation_config.json":       hubtest.String(`{}`),
		"model-00001-of-00002.weights": hubtest.Generated(8<<20, 3),
	}
	c.hub.AddRepo("org/e2e-model", files)
	var expect []string
	for p := range files {
		expect = append(expect, p+"="+c.hub.SHA256("org/e2e-model", "main", p))
	}

	readerRef := c.push(t, ctx, "reader", "v1", mustImage(t, reader, "/reader"))
	b, err := os.ReadFile(filepath.Join(c.root, "deploy", "examples", "pod-with-model-hostpath.yaml"))
	require.NoError(t, err)
	var pod corev1.Pod
	require.NoError(t, yaml.UnmarshalStrict(b, &pod))
	const exampleModel = "hf://Qwen/Qwen2.5-0.5B-Instruct@main"
	require.Equal(t, exampleModel, pod.Annotations[podrequest.Models])
	model := "hf://org/e2e-model@main"
	pod.Annotations[podrequest.Models] = model
	init := &pod.Spec.InitContainers[0]
	init.Image = imageRepo + ":" + c.tags[0]
	init.ImagePullPolicy = corev1.PullNever
	require.Equal(t, exampleModel, init.Command[len(init.Command)-1])
	init.Command[len(init.Command)-1] = model
	server := &pod.Spec.Containers[0]
	server.Image, server.Args, server.Ports, server.ReadinessProbe = readerRef, []string{"org/e2e-model", "main"}, nil, nil
	server.Resources = corev1.ResourceRequirements{} // no GPU here
	server.Env = append(server.Env, corev1.EnvVar{Name: "EXPECT", Value: strings.Join(expect, ",")})
	pod.Spec.RestartPolicy = corev1.RestartPolicyNever
	// The example names the default paths of the chart: the node's
	// containerd root is elsewhere here, and so is the agent's socket.
	for i := range pod.Spec.Volumes {
		hp := pod.Spec.Volumes[i].HostPath
		switch {
		case strings.HasPrefix(hp.Path, "/var/lib/containerd/"):
			hp.Path = filepath.Join(c.node.Containerd.Root, strings.TrimPrefix(hp.Path, "/var/lib/containerd/"))
		case hp.Path == "/run/weightd":
			hp.Path = c.runDir
		default:
			t.Fatalf("the example mounts %s, which this test does not map", hp.Path)
		}
	}
	start := time.Now()
	_, err = c.client.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, &pod, metav1.CreateOptions{})
	require.NoError(t, err)
	p := c.waitPod(t, ctx, metav1.NamespaceDefault, pod.Name, 3*time.Minute, func(p *corev1.Pod) bool {
		return p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
	})
	ready := time.Since(start).Seconds()
	term := p.Status.ContainerStatuses[0].State.Terminated
	require.NotNil(t, term)
	require.Equal(t, corev1.PodSucceeded, p.Status.Phase, "the reader: %s", term.Message)
	require.Equal(t, "ok", term.Message)
	// The init container ran first and ended before the reader started.
	require.Equal(t, int32(0), p.Status.InitContainerStatuses[0].State.Terminated.ExitCode)
	require.False(t, term.StartedAt.Before(&p.Status.InitContainerStatuses[0].State.Terminated.FinishedAt))
	return true, ready
}

// statusLabelAndPolicy checks what the cluster sees of the model of
// modelPod: a running pod's status annotation (modelPod's pod may have
// ended before the agent saw it), the node's label, and a PrefetchPolicy
// naming it counting the node as ready.
func (c *cluster) statusLabelAndPolicy(t *testing.T, ctx context.Context, sleeper string) {
	const model = "hf://org/e2e-model@main"
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "wants-model", Annotations: map[string]string{podrequest.Models: model}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: c.push(t, ctx, "sleeper", "v1", mustImage(t, sleeper, "/sleeper"))}}},
	}
	_, err := c.client.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	c.waitPod(t, ctx, metav1.NamespaceDefault, pod.Name, 2*time.Minute, func(p *corev1.Pod) bool {
		return p.Annotations[podrequest.Status] == "ready"
	})
	c.deletePod(t, ctx, pod.Name)
	require.Eventually(t, func() bool {
		n, err := c.client.CoreV1().Nodes().Get(ctx, c.node.Name, metav1.GetOptions{})
		return err == nil && n.Labels[nodestate.Label(model)] == nodestate.LabelReady
	}, time.Minute, 250*time.Millisecond, "the node never got %s", nodestate.Label(model))

	dyn, err := dynamic.NewForConfig(c.env.Config)
	require.NoError(t, err)
	pp := dyn.Resource(schema.GroupVersionResource{Group: "weightd.io", Version: "v1alpha1", Resource: "prefetchpolicies"})
	_, err = pp.Create(ctx, &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "weightd.io/v1alpha1",
		"kind":       "PrefetchPolicy",
		"metadata":   map[string]any{"name": "e2e"},
		"spec":       map[string]any{"nodeSelector": map[string]any{}, "models": []any{model}},
	}}, metav1.CreateOptions{})
	require.NoError(t, err)
	var status map[string]any
	require.Eventually(t, func() bool {
		u, err := pp.Get(ctx, "e2e", metav1.GetOptions{})
		if err != nil {
			return false
		}
		status, _ = u.Object["status"].(map[string]any)
		return status["nodeCount"] == int64(1) && status["readyNodes"] == int64(1)
	}, 2*time.Minute, 500*time.Millisecond, "the policy never counted the node ready")
}

// survives starts a download that stops halfway (the hub holds the second
// half of its file back), runs disrupt (the agent restarted one way or
// another), then lets the download finish: the model becomes ready without
// its verified half fetched again, and no blob of the cache is lost.
func (c *cluster) survives(t *testing.T, ctx context.Context, sleeper, repo string, seed uint64, disrupt func()) {
	const size = 64 << 20
	g := newGate(size/2, hubtest.Generated(size, seed))
	defer g.open()
	c.hub.AddRepo(repo, map[string]hubtest.Content{"model.safetensors": g})
	g.arm() // the hub read the file whole to hash it
	model := "hf://" + repo + "@main"
	before := c.cacheBlobs(t)
	sleeperRef := c.push(t, ctx, "sleeper", "v1", mustImage(t, sleeper, "/sleeper"))

	podName := strings.ReplaceAll(repo, "/", "-")
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: podName, Annotations: map[string]string{podrequest.Models: model}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: sleeperRef}}},
	}
	_, err := c.client.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, g.reached, 2*time.Minute, 100*time.Millisecond, "the download never reached the held-back half")

	disrupt()
	g.markResumed()
	g.open()
	c.waitPod(t, ctx, metav1.NamespaceDefault, podName, 3*time.Minute, func(p *corev1.Pod) bool {
		return p.Annotations[podrequest.Status] == "ready"
	})
	// A download restarted from zero would read the file from its start
	// again; one resumed reads on from its verified half.
	from := g.firstReadAfterResume()
	t.Logf("%s: after the disruption, the download read on from byte %d of %d", repo, from, size)
	require.GreaterOrEqual(t, from, int64(size)/4, "the download started over")
	after := c.cacheBlobs(t)
	for p, n := range before {
		require.Equal(t, n, after[p], "the cache lost %s", p)
	}
	c.deletePod(t, ctx, podName)
}

// gate is hub content whose bytes past limit wait, once armed, until
// open: a download that is in flight for as long as a test needs.
type gate struct {
	hubtest.Content
	limit    int64
	once     sync.Once
	released chan struct{}
	mu       sync.Mutex
	armed    bool
	hit      bool
	resumed  bool
	first    int64 // the lowest offset read since markResumed
}

// markResumed starts recording the lowest offset read.
func (g *gate) markResumed() {
	g.mu.Lock()
	g.resumed, g.first = true, g.Size()
	g.mu.Unlock()
}

func (g *gate) firstReadAfterResume() int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.first
}

func (g *gate) arm() {
	g.mu.Lock()
	g.armed = true
	g.mu.Unlock()
}

func newGate(limit int64, c hubtest.Content) *gate {
	return &gate{Content: c, limit: limit, released: make(chan struct{})}
}

func (g *gate) ReadAt(p []byte, off int64) (int, error) {
	g.mu.Lock()
	held := g.armed && !g.resumed && off+int64(len(p)) > g.limit
	g.hit = g.hit || held
	if g.resumed && off < g.first {
		g.first = off
	}
	g.mu.Unlock()
	if held {
		select {
		case <-g.released:
		case <-time.After(5 * time.Minute):
			return 0, fmt.Errorf("gate never opened")
		}
	}
	return g.Content.ReadAt(p, off)
}

func (g *gate) reached() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.hit
}

func (g *gate) open() { g.once.Do(func() { close(g.released) }) }

// runPod runs a pod of image (pulled always) until it is Running.
func (c *cluster) runPod(t *testing.T, ctx context.Context, podName, image string) {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: podName},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: image, ImagePullPolicy: corev1.PullAlways}}},
	}
	_, err := c.client.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)
	c.waitPod(t, ctx, metav1.NamespaceDefault, podName, 3*time.Minute, func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodRunning })
}

// deletePod deletes a pod of the default namespace and waits until it is
// gone.
func (c *cluster) deletePod(t *testing.T, ctx context.Context, podName string) {
	t.Helper()
	c.deletePodIn(t, ctx, metav1.NamespaceDefault, podName)
}

// deletePodIn deletes pod ns/podName and waits until it is gone.
func (c *cluster) deletePodIn(t *testing.T, ctx context.Context, ns, podName string) {
	t.Helper()
	grace := int64(0)
	require.NoError(t, c.client.CoreV1().Pods(ns).Delete(ctx, podName, metav1.DeleteOptions{GracePeriodSeconds: &grace}))
	require.Eventually(t, func() bool {
		_, err := c.client.CoreV1().Pods(ns).Get(ctx, podName, metav1.GetOptions{})
		return err != nil
	}, 2*time.Minute, 250*time.Millisecond)
}

// agentPID is the pid of the weightd agent running in pod p's container:
// found by the container's id in the process's cgroup, since other tests'
// agents run on the machine at the same time.
func agentPID(t *testing.T, p *corev1.Pod) int {
	t.Helper()
	require.NotEmpty(t, p.Status.ContainerStatuses, "pod %s has no container", p.Name)
	_, id, ok := strings.Cut(p.Status.ContainerStatuses[0].ContainerID, "://")
	require.True(t, ok && id != "", "pod %s: container id %q", p.Name, p.Status.ContainerStatuses[0].ContainerID)
	procs, err := filepath.Glob("/proc/[0-9]*/cmdline")
	require.NoError(t, err)
	for _, proc := range procs {
		b, err := os.ReadFile(proc)
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) < 2 || !strings.HasSuffix(args[0], "weightd") || args[1] != "agent" {
			continue
		}
		dir := filepath.Dir(proc)
		if cg, err := os.ReadFile(filepath.Join(dir, "cgroup")); err == nil && strings.Contains(string(cg), id) {
			pid, err := strconv.Atoi(filepath.Base(dir))
			require.NoError(t, err)
			return pid
		}
	}
	t.Fatalf("no weightd agent process in container %s of pod %s", id, p.Name)
	return 0
}

func mustImage(t *testing.T, bin, path string) v1.Image {
	t.Helper()
	img, err := kubenode.ProgramImage(bin, path)
	require.NoError(t, err)
	return img
}

func imageSize(t *testing.T, img v1.Image) int64 {
	t.Helper()
	layers, err := img.Layers()
	require.NoError(t, err)
	var n int64
	for _, l := range layers {
		s, err := l.Size()
		require.NoError(t, err)
		n += s
	}
	return n
}

func layerDigest(t *testing.T, l v1.Layer) string {
	t.Helper()
	d, err := l.Digest()
	require.NoError(t, err)
	return d.String()
}
