package kube

import (
	"context"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/warmpool"
)

// dirFetcher serves hf://org/NAME@main from root/NAME, as the cache would
// hold an adapter after its fetch.
type dirFetcher struct{ root string }

func (f dirFetcher) Fetch(_ context.Context, ref string) (string, error) {
	name, ok := strings.CutPrefix(ref, "hf://org/")
	name, main := strings.CutSuffix(name, "@main")
	if !ok || !main {
		return "", fmt.Errorf("%w: reference %q: not hf://org/NAME@main", api.ErrBadRequest, ref)
	}
	return filepath.Join(f.root, name), nil
}

// keepNothing is a warm pool's Bases that keeps nothing: the base is not
// fetched in this test.
type keepNothing struct{}

func (keepNothing) Keep(context.Context, warmpool.ServerSpec) error { return nil }
func (keepNothing) Drop(warmpool.ServerSpec)                        {}

// testRealPool runs WarmPods with the real warm pool against a vLLM test
// server (loopback HTTP, one adapter slot), discovered from its pod: a pod's
// adapter is staged, loaded and answered; the server pod lists it; when that
// pod goes, another pod's adapter takes the slot (the first, no longer in
// use, is evicted).
func testRealPool(t *testing.T, env *kubetest.Env) {
	const nodeName = "gpu-real"
	const base = "hf://org/base@main"
	_, err := env.CreateNode(t.Context(), nodeName, nil)
	require.NoError(t, err)
	srv, err := loratest.NewVLLM(loratest.Options{Base: "base", Slots: 1, MaxRank: 16})
	require.NoError(t, err)
	t.Cleanup(srv.Close)
	u, err := url.Parse(srv.URL())
	require.NoError(t, err)

	adapters := t.TempDir()
	for _, name := range []string{"sql-lora", "chat-lora"} {
		require.NoError(t, loratest.WriteAdapter(filepath.Join(adapters, name), loratest.AdapterSpec{Rank: 8}))
	}
	require.NoError(t, loratest.WriteAdapter(filepath.Join(adapters, "big-lora"), loratest.AdapterSpec{Rank: 32}))
	pool, err := warmpool.New(warmpool.Config{
		StageDir: t.TempDir(), Fetcher: dirFetcher{adapters}, Bases: keepNothing{},
		HealthInterval: 200 * time.Millisecond, CallTimeout: 5 * time.Second, LoadTimeout: 5 * time.Second,
		Logger: testLogger(t),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { assert.NoError(t, pool.Run(ctx)) })
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	runWarm(t, env, nodeName, pool)

	createPod(t, env, warmServerPod("real-vllm", nodeName, map[string]string{
		podrequest.WarmBase: base, podrequest.WarmRuntime: "vllm", podrequest.WarmPort: u.Port(),
		podrequest.WarmSlots: "1", podrequest.WarmMaxRank: "16",
	}))
	setRunning(t, env, "real-vllm", u.Hostname())
	eventually(t, 10*time.Second, func() string {
		if l := node(t, env, nodeName).Labels; l[nodestate.WarmLabel(base)] != "ready" {
			return fmt.Sprintf("node labels %v, want %s=ready once the server is healthy", l, nodestate.WarmLabel(base))
		}
		return ""
	})

	createPod(t, env, newPod("sql", nodeName, map[string]string{
		podrequest.LoraBase: base, podrequest.LoraAdapter: "hf://org/sql-lora", podrequest.LoraName: "sql",
	}))
	waitAnnotations(t, env, "sql", map[string]string{podrequest.LoraEndpoint: srv.URL(), podrequest.LoraModel: "sql"})
	assert.Equal(t, 1, srv.Loads("sql"))
	waitAnnotations(t, env, "real-vllm", map[string]string{nodestate.LoadedAdaptersAnnotation: `["sql"]`})

	// The one slot is in use by a live pod: another adapter waits (busy),
	// and is loaded once that pod goes.
	createPod(t, env, newPod("chat", nodeName, map[string]string{
		podrequest.LoraBase: base, podrequest.LoraAdapter: "hf://org/chat-lora", podrequest.LoraName: "chat",
	}))
	eventually(t, 10*time.Second, func() string {
		if e := getPod(t, env, "chat").Annotations[podrequest.LoraError]; !strings.HasPrefix(e, "busy: ") {
			return fmt.Sprintf("chat's error %q, want busy", e)
		}
		return ""
	})
	require.NoError(t, env.Clientset().CoreV1().Pods("default").Delete(t.Context(), "sql", metav1.DeleteOptions{}))
	waitAnnotations(t, env, "chat", map[string]string{podrequest.LoraEndpoint: srv.URL(), podrequest.LoraModel: "chat", podrequest.LoraError: ""})
	waitAnnotations(t, env, "real-vllm", map[string]string{nodestate.LoadedAdaptersAnnotation: `["chat"]`})
	assert.Equal(t, 1, srv.Unloads("sql"), "evicted once no pod used it")
	assert.Equal(t, 1, srv.Peak(), "the slot limit holds")

	// A rank over the server's maximum: refused before the server is
	// called, and not asked again.
	createPod(t, env, newPod("big", nodeName, map[string]string{podrequest.LoraBase: base, podrequest.LoraAdapter: "hf://org/big-lora"}))
	eventually(t, 10*time.Second, func() string {
		if e := getPod(t, env, "big").Annotations[podrequest.LoraError]; !strings.HasPrefix(e, "bad request: ") || !strings.Contains(e, "rank") {
			return fmt.Sprintf("big's error %q, want a bad request about its rank", e)
		}
		return ""
	})
	assert.Zero(t, srv.Loads(warmpool.AdapterName("hf://org/big-lora@main")))
}
