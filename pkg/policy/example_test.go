package policy_test

import (
	"context"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/policy"
	"github.com/weightd/weightd/pkg/prefetch"
)

// A policy's selector is evaluated against the node's own labels.
func ExampleMatches() {
	sel := &metav1.LabelSelector{
		MatchLabels: map[string]string{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
		MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "topology.kubernetes.io/zone", Operator: metav1.LabelSelectorOpIn, Values: []string{"eu-west-1a", "eu-west-1b"}},
		},
	}
	ok, _ := policy.Matches(sel, map[string]string{
		"nvidia.com/gpu.product":      "NVIDIA-H100-80GB-HBM3",
		"topology.kubernetes.io/zone": "eu-west-1b",
	})
	fmt.Println(ok)
	// Output: true
}

// A node's status entry, built from where each reference is.
func ExampleBuildEntry() {
	e := policy.BuildEntry("gpu-node-7", 2, []policy.RefState{
		{Shown: "hf://meta-llama/Llama-3.1-8B-Instruct@main", State: prefetch.StateReady, Bytes: 16 << 30},
		{Shown: "oci://docker.io/vllm/vllm-openai:v0.11.0", State: prefetch.StateFetching, Bytes: 3 << 30},
	}, time.Now())
	fmt.Println(e.State, e.Ready, e.Fetching, e.Bytes>>30, "GiB")
	// Output: Fetching [hf://meta-llama/Llama-3.1-8B-Instruct@main] [oci://docker.io/vllm/vllm-openai:v0.11.0] 19 GiB
}

// Wiring the controller into an agent: the node name comes from the
// downward API (spec.nodeName), the queue and the store are the agent's own.
func ExampleNew() {
	run := func(ctx context.Context, cfg *rest.Config, node string, q *prefetch.Queue, store *cache.Store) error {
		kc, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return err
		}
		dc, err := dynamic.NewForConfig(cfg)
		if err != nil {
			return err
		}
		c, err := policy.New(node, kc, dc, policy.FromQueue(q), store, policy.DefaultConfig())
		if err != nil {
			return err
		}
		return c.Run(ctx) // in the agent's errgroup, beside q.Run
	}
	_ = run
}
