package adversary

// Attack 3a, the agent's hub token for anyone: the HF token went on every
// hub request, whichever pod named the repository, so a pod of any
// namespace that named another team's private repository had the agent
// fetch it onto the node with the agent's token.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
)

func TestHFTokenForAnyNamespace(t *testing.T) {
	t.Parallel()
	const (
		node    = "gpu-node-1"
		private = "team-a/secret-model"
		token   = "hf_agent_token"
	)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	hub.AddRepo(private, map[string]hubtest.Content{
		"config.json":       hubtest.String(`{"model_type":"llama"}`),
		"model.safetensors": hubtest.String("team a's private weights"),
	}, hubtest.Private(token))
	hub.AddRepo("org/public-model", map[string]hubtest.Content{"config.json": hubtest.String(`{}`)})

	store, err := cache.Open(t.TempDir(), cache.WithRetries(2, time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	// The agent as the operator deploys it: with a token that reads team
	// a's repository, for team a's pods and the operator's prefetches.
	hfSrc, err := hf.New(nil, hf.WithEndpoint(hub.URL), hf.WithToken(token))
	require.NoError(t, err)
	q := prefetch.NewQueue(store, source.Sources{ref.KindHF: hfSrc}, prefetch.WithResolveRetries(1, 0))

	env := kubetest.NewT(t, kubetest.Config{})
	cs := env.Clientset()
	in, err := kube.NewPodIntake(cs, node, q, kube.WithStatusInterval(50*time.Millisecond, 100*time.Millisecond), kube.WithFirstStatusDelay(0))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() { _ = q.Run(ctx) })
	wg.Go(func() { _ = in.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })

	// A pod of another team names team a's private repository.
	const ns = "team-b"
	_, err = cs.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cs.CoreV1().ServiceAccounts(ns).Create(t.Context(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	for name, r := range map[string]string{"thief": "hf://" + private + "@main", "public": "hf://org/public-model@main"} {
		_, err = cs.CoreV1().Pods(ns).Create(t.Context(), &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Annotations: map[string]string{"weightd.io/models": r}},
			Spec: corev1.PodSpec{
				NodeName:   node,
				Containers: []corev1.Container{{Name: "main", Image: "registry.k8s.io/pause:3.10"}},
			},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	status := func(name string) string {
		var s string
		require.Eventually(t, func() bool {
			p, err := cs.CoreV1().Pods(ns).Get(t.Context(), name, metav1.GetOptions{})
			require.NoError(t, err)
			s = p.Annotations["weightd.io/status"]
			return s == "ready" || strings.HasPrefix(s, "failed")
		}, 30*time.Second, 50*time.Millisecond, "pod %s: no final status", name)
		return s
	}
	require.Equal(t, "ready", status("public"), "a public model is fetched for any pod")
	thief := status("thief")
	require.NotEqual(t, "ready", thief, "a pod of namespace %s had the agent fetch %s with the agent's hub token", ns, private)
	require.Contains(t, thief, "401", "the hub refused the pod as it refuses anyone without a token")
	_, err = store.Stat(digest.FromString("team a's private weights"))
	require.ErrorIs(t, err, content.ErrNotFound, "the private weights are not on the node")

	// The operator's own request (the CLI, a PrefetchPolicy) still uses it.
	j, err := q.Submit("hf://"+private+"@main", prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := j.Wait(t.Context())
	require.NoError(t, err, fmt.Sprint(st))
}
