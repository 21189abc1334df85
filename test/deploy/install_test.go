package deploy_test

import (
	"bytes"
	"os/exec"
	"slices"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/test/deploy/manifests"
)

// TestHelmInstall installs the chart with Helm on a real API server, with
// every optional feature that needs no other CRDs (the extender and a
// second scheduler; the Prometheus Operator's objects need its CRDs), so
// that the API server validates every object. The gossip key the chart
// makes is kept by an upgrade, and by an uninstall and a new install.
func TestHelmInstall(t *testing.T) {
	helm := services.RequireHelm(t)
	env := kubetest.NewT(t, kubetest.Config{})
	ctx := t.Context()
	cs := env.Clientset()
	henv := helmEnv(t)
	h := func(args ...string) string {
		t.Helper()
		args = append(args, "--kubeconfig", env.Kubeconfig)
		cmd := exec.CommandContext(ctx, helm, args...)
		cmd.Env = henv
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out.Bytes())
		}
		return out.String()
	}
	values := []string{
		"--set", "extender.enabled=true", "--set", "extender.scheduler=second",
		"--set", "warm.dramBudget=64GiB", "--set", "gossip.join={10.0.0.1:7946}",
	}
	install := append([]string{"install", manifests.Release, chart, "-n", manifests.Namespace, "--create-namespace"}, values...)
	t.Logf("helm install:\n%s", h(install...))

	// key is the gossip key and the peer CA, certificate and key.
	key := func() []byte {
		t.Helper()
		s, err := cs.CoreV1().Secrets(manifests.Namespace).Get(ctx, "weightd-gossip", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(s.Data["keys"]) < 32 {
			t.Fatalf("gossip Secret keys %q: want a base64 key", s.Data["keys"])
		}
		ca, err := cs.CoreV1().Secrets(manifests.Namespace).Get(ctx, "weightd-peer-ca", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(ca.Data["ca.crt"], []byte("BEGIN CERTIFICATE")) || !bytes.Contains(ca.Data["ca.key"], []byte("PRIVATE KEY")) {
			t.Fatalf("peer CA Secret: want a PEM certificate and key, got %d and %d bytes", len(ca.Data["ca.crt"]), len(ca.Data["ca.key"]))
		}
		return slices.Concat(s.Data["keys"], ca.Data["ca.crt"], ca.Data["ca.key"])
	}
	first := key()
	for _, name := range []string{"weightd", "weightd-extender", "weightd-scheduler"} {
		if name == "weightd" {
			if _, err := cs.AppsV1().DaemonSets(manifests.Namespace).Get(ctx, name, metav1.GetOptions{}); err != nil {
				t.Error(err)
			}
			continue
		}
		if _, err := cs.AppsV1().Deployments(manifests.Namespace).Get(ctx, name, metav1.GetOptions{}); err != nil {
			t.Error(err)
		}
	}
	if _, err := cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(ctx, "weightd-agent-own-node", metav1.GetOptions{}); err != nil {
		t.Error(err)
	}
	waitCRD(t, ctx, env, "prefetchpolicies.weightd.io")

	// An upgrade that changes the configuration keeps the key.
	upgrade := append([]string{"upgrade", manifests.Release, chart, "-n", manifests.Namespace, "--set", "cache.maxJobs=3"}, values...)
	t.Logf("helm upgrade:\n%s", h(upgrade...))
	cm, err := cs.CoreV1().ConfigMaps(manifests.Namespace).Get(ctx, "weightd-config", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(cm.Data["config.yaml"], "max-jobs: 3") {
		t.Errorf("the upgrade did not change the configuration:\n%s", cm.Data["config.yaml"])
	}
	if got := key(); !bytes.Equal(got, first) {
		t.Errorf("the upgrade changed the gossip key or peer CA: %q, was %q", got, first)
	}

	// An uninstall leaves the Secrets (resource-policy keep); the hook,
	// which needs kubelets, is left out here (test/e2e runs it). A new
	// install takes the kept Secret over, and its key.
	h("uninstall", manifests.Release, "-n", manifests.Namespace, "--no-hooks")
	if _, err := cs.AppsV1().DaemonSets(manifests.Namespace).Get(ctx, "weightd", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the DaemonSet after uninstall: %v, want not found", err)
	}
	if got := key(); !bytes.Equal(got, first) {
		t.Errorf("the uninstall changed the gossip key or peer CA: %q, was %q", got, first)
	}
	h(install[:len(install)-len(values)]...)
	if got := key(); !bytes.Equal(got, first) {
		t.Errorf("a new install changed the kept gossip key or peer CA: %q, was %q", got, first)
	}
}
