package kubetest_test

import (
	"context"
	"fmt"
	"log"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/kubetest"
)

// An API server for a program (tests use NewT): a node, a restart, and the
// same client carrying on. It needs the binaries of `make kube-assets`.
func Example() {
	ctx := context.Background()
	env, err := kubetest.Start(ctx, kubetest.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer env.Close()

	if _, err := env.CreateNode(ctx, "gpu-0", map[string]string{"nvidia.com/gpu.present": "true"}); err != nil {
		log.Fatal(err)
	}
	// kubectl --kubeconfig env.Kubeconfig works too.
	env.StopAPIServer()
	if err := env.StartAPIServer(ctx); err != nil {
		log.Fatal(err)
	}
	nodes, err := env.Clientset().CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(len(nodes.Items), "node")
}
