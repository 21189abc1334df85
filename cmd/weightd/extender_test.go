package main

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

// TestExtenderServer runs `weightd extender --kubeconfig` against a real API
// server: not ready until its informer synced, then it scores nodes by their
// summary, serves its metrics, and stops gracefully.
func TestExtenderServer(t *testing.T) {
	t.Parallel()
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	const ref = "hf://org/llama@main"
	sum, err := nodestate.Summary{Entries: []nodestate.Entry{{Key: nodestate.Key(ref), Ref: ref, State: nodestate.StateReady, Bytes: 100, Total: 100}}}.Encode()
	require.NoError(t, err)
	for _, name := range []string{"warm", "cold"} {
		_, err := env.CreateNode(ctx, name, nil)
		require.NoError(t, err)
	}
	n, err := env.Clientset().CoreV1().Nodes().Get(ctx, "warm", metav1.GetOptions{})
	require.NoError(t, err)
	n.Annotations = map[string]string{nodestate.SummaryAnnotation: sum}
	_, err = env.Clientset().CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	require.NoError(t, err)

	rc, err := kube.RESTConfig(env.Kubeconfig, 0, 0, "weightd-extender-test")
	require.NoError(t, err)
	cfg := extenderConfig{Listen: "127.0.0.1:0", MaxBody: 1 << 20, ShutdownTimeout: 5 * time.Second}
	x, err := newExtenderServer(cfg, rc, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	base := "http://" + x.Addr()
	get := func(path string) (int, string) {
		resp, err := http.Get(base + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- x.Run(rctx) }()
	require.Eventually(t, func() bool { code, _ := get("/readyz"); return code == http.StatusOK }, 30*time.Second, 20*time.Millisecond)
	code, _ := get("/healthz")
	assert.Equal(t, http.StatusOK, code)

	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "default", Annotations: map[string]string{podrequest.Models: ref}}}
	body, err := json.Marshal(extenderv1.ExtenderArgs{Pod: pod, NodeNames: &[]string{"warm", "cold"}})
	require.NoError(t, err)
	resp, err := http.Post(base+"/prioritize", "application/json", strings.NewReader(string(body)))
	require.NoError(t, err)
	var got extenderv1.HostPriorityList
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&got))
	resp.Body.Close()
	assert.Equal(t, extenderv1.HostPriorityList{{Host: "warm", Score: 10}, {Host: "cold", Score: 0}}, got)

	code, metrics := get("/metrics")
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, metrics, `weightd_extender_request_seconds_count{verb="prioritize"} 1`)
	assert.Contains(t, metrics, "weightd_extender_nodes 2")
	assert.Contains(t, metrics, "weightd_build_info")

	stop()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("extender did not stop")
	}
	_, err = http.Get(base + "/healthz")
	assert.Error(t, err, "listener closed after shutdown")
}

func TestExtenderFlags(t *testing.T) {
	t.Parallel()
	var stdout, stderr strings.Builder
	code := run(t.Context(), []string{"extender", "--help"}, &stdout, &stderr)
	assert.Equal(t, 0, code)
	for _, flag := range []string{"--listen", "--kubeconfig", "--max-body", "--shutdown-timeout"} {
		assert.Contains(t, stdout.String(), flag)
	}
	_, err := newExtenderServer(extenderConfig{Listen: "127.0.0.1:0"}, nil, slog.Default())
	assert.ErrorContains(t, err, "--shutdown-timeout")
}

// TestExtenderNotReady: with no API server to list nodes from, the
// extender is alive but not ready, answers prioritize with zero scores
// (it knows no node), and still stops gracefully.
func TestExtenderNotReady(t *testing.T) {
	t.Parallel()
	rc := &rest.Config{Host: "https://127.0.0.1:1", Timeout: time.Second}
	cfg := extenderConfig{Listen: "127.0.0.1:0", MaxBody: 1 << 20, ShutdownTimeout: 5 * time.Second}
	x, err := newExtenderServer(cfg, rc, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	ctx, stop := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- x.Run(ctx) }()
	base := "http://" + x.Addr()
	require.Eventually(t, func() bool {
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 10*time.Millisecond)
	resp, err := http.Get(base + "/readyz")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)

	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Annotations: map[string]string{podrequest.Models: "hf://org/m@main"}}}
	body, err := json.Marshal(extenderv1.ExtenderArgs{Pod: pod, NodeNames: &[]string{"a"}})
	require.NoError(t, err)
	resp, err = http.Post(base+"/prioritize", "application/json", strings.NewReader(string(body)))
	require.NoError(t, err)
	var got extenderv1.HostPriorityList
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&got))
	resp.Body.Close()
	assert.Equal(t, extenderv1.HostPriorityList{{Host: "a", Score: 0}}, got)

	stop()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("extender did not stop")
	}
}
