package extender

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	configv1 "k8s.io/kube-scheduler/config/v1"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/nodestate"
)

// kubeScheduler returns the path of a kube-scheduler binary of the cluster's
// version: $WEIGHTD_KUBE_SCHEDULER, else the one `make kube-assets` builds
// beside kubetest's kube-apiserver. The test skips without one, except
// under CI=true, where it fails.
func kubeScheduler(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("WEIGHTD_KUBE_SCHEDULER"); p != "" {
		return p
	}
	p, err := kubetest.Program(kubetest.SchedulerBin)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	return p
}

// TestKubeScheduler runs a real kube-scheduler with deploy/scheduler's
// configuration (only the extender's address, the kubeconfig and leader
// election changed) against a real API server and this extender: pods
// asking for a model land on the node that holds it, a pod requiring a warm
// node that no node is warm for stays pending with the extender's reason,
// and pods without weightd annotations schedule as usual.
func TestKubeScheduler(t *testing.T) {
	t.Parallel()
	bin := kubeScheduler(t)
	env := kubetest.NewT(t, kubetest.Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	client, err := kubernetes.NewForConfig(env.Config)
	require.NoError(t, err)

	sum, err := nodestate.Summary{Entries: []nodestate.Entry{entry(refA, 100*gb, 100*gb), entry(refB, 1*gb, 10*gb)}}.Encode()
	require.NoError(t, err)
	for _, name := range []string{"gpu-cold-1", "gpu-warm", "gpu-cold-2"} {
		n, err := env.CreateNode(ctx, name, nil)
		require.NoError(t, err)
		// The API server taints new nodes not-ready; with no node
		// lifecycle controller running, lift it as that controller would
		// for a Ready node.
		n.Spec.Taints = nil
		_, err = client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	n, err := client.CoreV1().Nodes().Get(ctx, "gpu-warm", metav1.GetOptions{})
	require.NoError(t, err)
	n.Labels[nodestate.Label(refA)] = nodestate.LabelReady
	n.Annotations = map[string]string{nodestate.SummaryAnnotation: sum}
	_, err = client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	require.NoError(t, err)

	c := NewCache()
	w := NewWatcher(client, c)
	go w.Run(ctx)
	require.NoError(t, w.WaitSynced(ctx))
	srv, reg := testServer(t, c)

	// deploy/scheduler/scheduler-config.yaml, pointed at this API server
	// and this extender.
	b, err := os.ReadFile(filepath.Join(deployDir, "scheduler-config.yaml"))
	require.NoError(t, err)
	var cfg configv1.KubeSchedulerConfiguration
	require.NoError(t, yaml.UnmarshalStrict(b, &cfg))
	cfg.ClientConnection.Kubeconfig = env.Kubeconfig
	leader := false
	cfg.LeaderElection.LeaderElect = &leader
	cfg.Extenders[0].URLPrefix = srv.URL
	b, err = yaml.Marshal(cfg)
	require.NoError(t, err)
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "scheduler-config.yaml")
	require.NoError(t, os.WriteFile(cfgPath, b, 0o600))

	var logs bytes.Buffer
	cmd := exec.Command(bin, "--config="+cfgPath, "--secure-port=0", "--v=2")
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("kube-scheduler:\n%s", lastLines(logs.String(), 40))
		}
	})

	pod := func(name string, ann map[string]string) {
		t.Helper()
		p := mkPod(ann, "registry.k8s.io/pause:3.10")
		p.Name, p.Namespace = name, "default"
		_, err := client.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	// nodeOf is where the pod is bound ("" while pending or on error; it
	// runs inside Eventually's goroutine, so it must not fail the test).
	nodeOf := func(name string) string {
		p, err := client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return ""
		}
		return p.Spec.NodeName
	}
	pod("wants-a-1", models(refA))
	pod("wants-a-2", models(refA+","+refB))
	pod("warm-a", warm(refA))
	pod("warm-u", warm(refU))
	pod("plain", nil)
	for _, name := range []string{"wants-a-1", "wants-a-2", "warm-a", "plain"} {
		require.Eventually(t, func() bool { return nodeOf(name) != "" }, time.Minute, 100*time.Millisecond, "pod %s not scheduled", name)
	}
	assert.Equal(t, "gpu-warm", nodeOf("wants-a-1"))
	assert.Equal(t, "gpu-warm", nodeOf("wants-a-2"))
	assert.Equal(t, "gpu-warm", nodeOf("warm-a"))

	// No node holds U: the pod stays pending, and says why.
	require.Eventually(t, func() bool {
		events, err := client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=warm-u"})
		if err != nil {
			return false
		}
		for _, e := range events.Items {
			if e.Reason == "FailedScheduling" && strings.Contains(e.Message, "weightd: not warm: hf://org/unknown@main (absent)") {
				return true
			}
		}
		return false
	}, time.Minute, 100*time.Millisecond, "no FailedScheduling event with the extender's reason")
	assert.Empty(t, nodeOf("warm-u"))
	p, err := client.CoreV1().Pods("default").Get(ctx, "warm-u", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, corev1.PodPending, p.Status.Phase)
	assert.Positive(t, metric(t, reg, "weightd_extender_request_seconds"))
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// TestSecondScheduler runs deploy/scheduler/second-scheduler as a cluster
// would: its RBAC applied by kubectl, a real kube-scheduler acting as its
// service account with its config.yaml (only the API server, the
// extender's address and the secure port changed), leader election
// included. A pod naming weightd-scheduler lands on the warm node, and the
// scheduler's /readyz answers as the Deployment's probe asks.
func TestSecondScheduler(t *testing.T) {
	t.Parallel()
	bin := kubeScheduler(t)
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Skipf("skipping: no kubectl: %v", err)
	}
	env := kubetest.NewT(t, kubetest.Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	client, err := kubernetes.NewForConfig(env.Config)
	require.NoError(t, err)
	const ns = "weightd-system"
	require.NoError(t, env.EnsureNamespace(ctx, ns))
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", env.Kubeconfig, "apply", "-k", filepath.Join(deployDir, "second-scheduler")).CombinedOutput()
	require.NoError(t, err, "%s", out)

	for _, name := range []string{"gpu-cold", "gpu-warm"} {
		n, err := env.CreateNode(ctx, name, nil)
		require.NoError(t, err)
		n.Spec.Taints = nil // as the node lifecycle controller would
		if name == "gpu-warm" {
			n.Labels[nodestate.Label(refA)] = nodestate.LabelReady
		}
		_, err = client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		require.NoError(t, err)
	}
	c := NewCache()
	w := NewWatcher(client, c)
	go w.Run(ctx)
	require.NoError(t, w.WaitSynced(ctx))
	srv, _ := testServer(t, c)

	// The scheduler's identity: its service account's token.
	tok, err := client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "weightd-scheduler", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{}}, metav1.CreateOptions{})
	require.NoError(t, err)
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	require.NoError(t, kubetest.WriteKubeconfig(kubeconfig, &rest.Config{Host: env.Host, BearerToken: tok.Status.Token, TLSClientConfig: rest.TLSClientConfig{CAData: env.Config.CAData}}))

	b, err := os.ReadFile(filepath.Join(deployDir, "second-scheduler", "config.yaml"))
	require.NoError(t, err)
	var cfg configv1.KubeSchedulerConfiguration
	require.NoError(t, yaml.UnmarshalStrict(b, &cfg))
	require.Len(t, cfg.Profiles, 1)
	require.NotNil(t, cfg.Profiles[0].SchedulerName)
	schedulerName := *cfg.Profiles[0].SchedulerName
	cfg.ClientConnection.Kubeconfig = kubeconfig
	cfg.Extenders[0].URLPrefix = srv.URL
	b, err = yaml.Marshal(cfg)
	require.NoError(t, err)
	cfgPath := filepath.Join(dir, "config.yaml")
	require.NoError(t, os.WriteFile(cfgPath, b, 0o600))

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	var logs bytes.Buffer
	cmd := exec.Command(bin, "--config="+cfgPath, "--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(port), "--authentication-kubeconfig="+kubeconfig, "--authorization-kubeconfig="+kubeconfig)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("kube-scheduler:\n%s", lastLines(logs.String(), 40))
		}
	})

	p := mkPod(models(refA), "registry.k8s.io/pause:3.10")
	p.Namespace, p.Spec.SchedulerName = "default", schedulerName
	_, err = client.CoreV1().Pods("default").Create(ctx, p, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		got, err := client.CoreV1().Pods("default").Get(ctx, p.Name, metav1.GetOptions{})
		return err == nil && got.Spec.NodeName != ""
	}, time.Minute, 100*time.Millisecond, "pod not scheduled by %s", schedulerName)
	got, err := client.CoreV1().Pods("default").Get(ctx, p.Name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "gpu-warm", got.Spec.NodeName)

	lease, err := client.CoordinationV1().Leases(ns).Get(ctx, "weightd-scheduler", metav1.GetOptions{})
	require.NoError(t, err, "the scheduler leads through its own lease")
	assert.NotEmpty(t, *lease.Spec.HolderIdentity)

	insecure := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	resp, err := insecure.Get(fmt.Sprintf("https://127.0.0.1:%d/readyz", port))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "the Deployment's readiness probe")
}
