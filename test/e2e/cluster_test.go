package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/freeport"
	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/internal/imagebuild"
	"github.com/weightd/weightd/internal/kubenode"
	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/services"
)

// The chart's release, its namespace and the agent's image (imported, never
// pulled: pullPolicy Never).
const (
	release   = "weightd"
	namespace = "weightd-system"
	imageRepo = "weightd.test/weightd"
)

// cluster is one node with weightd installed by its chart.
type cluster struct {
	env      *kubetest.Env
	node     *kubenode.Node
	client   kubernetes.Interface
	registry *services.Registry
	hub      *hubtest.Hub
	helm     string
	root     string // the repository root, where charts/weightd is
	dir      string

	cacheRoot   string // the agent's cache on the host: <containerd root>/weightd
	runDir      string // the agent's API socket's directory on the host
	metricsPort int
	gossipPort  int    // the agent's gossip (TCP and UDP) host port
	chunkPort   int    // the agent's chunk server's host port
	bin         string // the weightd executable in the agent's image
	values      string // the chart's values file
	tags        []string
}

// requireAll skips without what the e2e needs, except under CI=true.
func requireAll(t *testing.T) string {
	t.Helper()
	kubetest.Require(t)
	services.RequireRegistry(t)
	helm := services.RequireHelm(t)
	if err := kubenode.Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	return helm
}

// lockMachine waits until no other real-kubelet cluster of this test runs
// on the machine, and keeps others off until t's cleanups are done: two at
// once broke each other's agents (a run by hand beside make test's).
func lockMachine(t *testing.T, ctx context.Context) {
	f, err := os.OpenFile(filepath.Join(os.TempDir(), "weightd-e2e.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() }) // the lock goes with the file, after the cluster's own cleanups
	for waited := false; ; waited = true {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return
		}
		require.ErrorIs(t, err, unix.EWOULDBLOCK)
		if !waited {
			t.Log("waiting for another real-kubelet e2e on this machine to finish")
		}
		select {
		case <-ctx.Done():
			t.Fatalf("another real-kubelet e2e held the machine: %v", ctx.Err())
		case <-time.After(time.Second):
		}
	}
}

// newCluster starts the control plane, a node, a registry and a hub, builds
// weightd's image as `make image` does, imports it under two tags (the
// second for the rolling update) and installs the chart.
func newCluster(t *testing.T, ctx context.Context) *cluster {
	c := &cluster{helm: requireAll(t), dir: t.TempDir()}
	lockMachine(t, ctx)
	var err error
	c.root, err = filepath.Abs("../..")
	require.NoError(t, err)
	c.env = kubetest.NewT(t, kubetest.Config{ControlPlane: true})
	c.client = c.env.Clientset()
	c.registry = services.NewRegistryT(t, services.RegistryConfig{Dir: filepath.Join(c.dir, "registry")})
	c.hub = hubtest.New()
	t.Cleanup(c.hub.Close)

	c.node, err = kubenode.Start(ctx, c.env, kubenode.Config{Name: "e2e-node", Dir: filepath.Join(c.dir, "node")})
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kubelet log:\n%s", c.node.LogTail())
			c.logAgent(t)
		}
		require.NoError(t, c.node.Close())
	})
	c.cacheRoot = filepath.Join(c.node.Containerd.Root, "weightd")
	c.runDir = filepath.Join(c.dir, "run")

	c.tags = []string{"e2e-1", "e2e-2"}
	archive := filepath.Join(c.dir, "weightd-image.tar")
	bin, err := imagebuild.Compile(ctx, imagebuild.CompileOptions{ModuleDir: c.root, Out: filepath.Join(c.dir, "weightd"), Version: "e2e", Commit: "e2e"})
	require.NoError(t, err)
	c.bin = bin.Path
	idx, err := imagebuild.Build(ctx, imagebuild.Options{Binaries: []imagebuild.Binary{bin}})
	require.NoError(t, err)
	for _, tag := range c.tags {
		require.NoError(t, imagebuild.WriteTarball(archive, imageRepo+":"+tag, idx))
		require.NoError(t, c.node.ImportArchive(ctx, archive))
	}

	ports, err := freeport.Ports("127.0.0.1", 4)
	require.NoError(t, err)
	c.metricsPort, c.gossipPort, c.chunkPort = ports[0], ports[1], ports[2]
	values := map[string]any{
		"image": map[string]any{"repository": imageRepo, "tag": c.tags[0], "pullPolicy": "Never"},
		"containerd": map[string]any{
			"root":       c.node.Containerd.Root,
			"socket":     c.node.Containerd.Address,
			"configPath": c.node.Containerd.HostsDir,
		},
		"mirror": map[string]any{"addr": "127.0.0.1:" + strconv.Itoa(ports[3]), "registries": []string{c.registry.Addr}},
		"gossip": map[string]any{"port": c.gossipPort, "chunkPort": c.chunkPort},
		"agent": map[string]any{
			"metricsPort": c.metricsPort,
			"runDir":      c.runDir,
			"logFormat":   "text",
			"config": map[string]any{
				"insecure-registries": c.registry.Addr,
				"hf-endpoint":         c.hub.URL,
			},
			// No kube-proxy routes the kubernetes Service's address here:
			// the in-cluster configuration reaches the API server directly.
			"extraEnv": []map[string]string{
				{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
				{"name": "KUBERNETES_SERVICE_PORT", "value": apiPort(t, c.env.Host)},
			},
		},
	}
	// The agent is the node plugin of models.weightd.io, at the kubelet's
	// directory of this node.
	values["csi"] = map[string]any{"enabled": true, "kubeletDir": c.node.KubeletDir}
	// The post-delete hook's Job asks the API server too.
	values["cleanup"] = map[string]any{"extraEnv": values["agent"].(map[string]any)["extraEnv"]}
	b, err := yaml.Marshal(values)
	require.NoError(t, err)
	c.values = filepath.Join(c.dir, "values.yaml")
	require.NoError(t, os.WriteFile(c.values, b, 0o644))
	c.helmRun(t, ctx, "install", release, filepath.Join(c.root, "charts", "weightd"), "--namespace", namespace, "--create-namespace", "-f", c.values)
	c.waitAgentReady(t, ctx, c.tags[0])
	return c
}

// helmRun runs helm against the cluster and fails the test if it fails.
func (c *cluster) helmRun(t *testing.T, ctx context.Context, args ...string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, c.helm, args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.env.Kubeconfig, "HELM_CACHE_HOME="+filepath.Join(c.dir, "helm-cache"), "HELM_CONFIG_HOME="+filepath.Join(c.dir, "helm-config"), "HELM_DATA_HOME="+filepath.Join(c.dir, "helm-data"))
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "helm %v:\n%s", args, out)
}

// waitAgentReady waits until the DaemonSet's one pod runs the image tag and
// is Ready, and returns it.
func (c *cluster) waitAgentReady(t *testing.T, ctx context.Context, tag string) *corev1.Pod {
	t.Helper()
	var last string
	for deadline := time.Now().Add(3 * time.Minute); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		ds, err := c.client.AppsV1().DaemonSets(namespace).Get(ctx, release, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			continue
		}
		if p := c.agentPod(t, ctx); p != nil && p.Spec.Containers[0].Image == imageRepo+":"+tag && podReady(p) && dsSettled(ds) {
			return p
		}
		last = fmt.Sprintf("daemonset status %+v", ds.Status)
	}
	t.Fatalf("the agent never became Ready on %s: %s", tag, last)
	return nil
}

func dsSettled(ds *appsv1.DaemonSet) bool {
	s := ds.Status
	return s.ObservedGeneration >= ds.Generation && s.DesiredNumberScheduled == 1 && s.NumberReady == 1 && s.UpdatedNumberScheduled == 1
}

// agentPod returns the agent's pod that is not being deleted, or nil.
func (c *cluster) agentPod(t *testing.T, ctx context.Context) *corev1.Pod {
	pods, err := c.client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=agent"})
	require.NoError(t, err)
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil {
			return &pods.Items[i]
		}
	}
	return nil
}

func podReady(p *corev1.Pod) bool {
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}

// logAgent logs the end of the agent containers' logs, which the kubelet
// writes under /var/log/pods.
func (c *cluster) logAgent(t *testing.T) {
	logs, _ := filepath.Glob("/var/log/pods/" + namespace + "_" + release + "-*/agent/*.log")
	for _, l := range logs {
		b, _ := os.ReadFile(l)
		if len(b) > 6000 {
			b = b[len(b)-6000:]
		}
		t.Logf("%s:\n%s", l, b)
	}
}

// metric returns the sum of the agent's samples of a metric whose line
// starts with prefix (name and labels), from its metrics port.
func (c *cluster) metric(t *testing.T, prefix string) float64 {
	t.Helper()
	return metricAt(t, net.JoinHostPort("127.0.0.1", strconv.Itoa(c.metricsPort)), prefix)
}

// metricAt returns the sum of the samples of a metric whose line starts with
// prefix (name and labels), from the /metrics of an agent at addr.
func metricAt(t *testing.T, addr, prefix string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var sum float64
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, prefix) {
			f := strings.Fields(line)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			require.NoError(t, err)
			sum += v
		}
	}
	return sum
}

// push pushes img to the registry as repo:tag and returns its reference.
func (c *cluster) push(t *testing.T, ctx context.Context, repo, tag string, img v1.Image) string {
	t.Helper()
	ref := c.registry.Addr + "/" + repo + ":" + tag
	r, err := name.ParseReference(ref, name.Insecure)
	require.NoError(t, err)
	require.NoError(t, remote.Write(r, img, remote.WithContext(ctx)))
	return ref
}

// cacheBlobs lists the cache's blob files with their sizes.
func (c *cluster) cacheBlobs(t *testing.T) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	err := filepath.WalkDir(filepath.Join(c.cacheRoot, "blobs"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		out[p] = fi.Size()
		return nil
	})
	require.NoError(t, err)
	return out
}

func apiPort(t *testing.T, host string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(strings.TrimPrefix(host, "https://"))
	require.NoError(t, err)
	return port
}

// waitPod polls pod ns/name until done says so, and fails the test with the
// pod's last status after timeout.
func (c *cluster) waitPod(t *testing.T, ctx context.Context, ns, podName string, timeout time.Duration, done func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	var err error
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		p, err = c.client.CoreV1().Pods(ns).Get(ctx, podName, metav1.GetOptions{})
		if err == nil && done(p) {
			return p
		}
	}
	var status []byte
	if p != nil {
		status, _ = yaml.Marshal(p.Status)
	}
	t.Fatalf("pod %s/%s: condition not met in %s (last error %v); status:\n%s", ns, podName, timeout, err, bytes.TrimSpace(status))
	return nil
}
