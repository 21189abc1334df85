package kubetest_test

import (
	"net"
	"strconv"
	"strings"
	"testing"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/testbed"
)

// TestNetns serves the API inside h0's network namespace and reaches it
// from h1, as agents in a benchmark's hosts do, across an API server
// restart.
func TestNetns(t *testing.T) {
	kubetest.Require(t)
	requireKubectl(t)
	tb := testbed.NewT(t, testbed.Config{Hosts: 2})
	h := tb.Hosts()
	env := kubetest.NewT(t, kubetest.Config{Netns: h[0].NS, NetnsAddr: h[0].Addr.String()})
	if want := "https://" + net.JoinHostPort(h[0].Addr.String(), strconv.Itoa(port(t, env.Host))); env.NetnsHost != want {
		t.Errorf("NetnsHost = %q, want %q", env.NetnsHost, want)
	}
	ctx := t.Context()
	if _, err := env.CreateNode(ctx, "n1", nil); err != nil {
		t.Fatal(err)
	}
	kubectl := func() {
		t.Helper()
		out, err := h[1].Command(ctx, "kubectl", "--kubeconfig", env.NetnsKubeconfig, "get", "nodes", "-o", "name").CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl in %s: %v\n%s", h[1].Name, err, out)
		}
		if strings.TrimSpace(string(out)) != "node/n1" {
			t.Errorf("kubectl get nodes = %q", out)
		}
	}
	kubectl()
	if err := env.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	if err := h[1].Command(ctx, "kubectl", "--kubeconfig", env.NetnsKubeconfig, "--request-timeout=2s", "get", "nodes").Run(); err == nil {
		t.Error("kubectl succeeded while the API server was stopped")
	}
	if err := env.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	kubectl()
}

func port(t *testing.T, host string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(strings.TrimPrefix(host, "https://"))
	if err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(p)
	return n
}
