package extender

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/labels"
	configv1 "k8s.io/kube-scheduler/config/v1"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/kubetest"
)

const deployDir = "../../deploy/scheduler"

// deployed is what deploy/scheduler holds, each document parsed strictly
// into its real type: an unknown or misspelt field is an error.
type deployed struct {
	namespace  string
	account    *corev1.ServiceAccount
	role       *rbacv1.ClusterRole
	binding    *rbacv1.ClusterRoleBinding
	service    *corev1.Service
	deployment *appsv1.Deployment
	scheduler  *configv1.KubeSchedulerConfiguration
	kustomized []string
}

func readDeploy(t *testing.T) deployed {
	t.Helper()
	var d deployed
	var kust struct {
		APIVersion string           `json:"apiVersion"`
		Kind       string           `json:"kind"`
		Namespace  string           `json:"namespace"`
		Resources  []string         `json:"resources"`
		Images     []map[string]any `json:"images"`
	}
	b, err := os.ReadFile(filepath.Join(deployDir, "kustomization.yaml"))
	require.NoError(t, err)
	require.NoError(t, yaml.UnmarshalStrict(b, &kust))
	d.namespace, d.kustomized = kust.Namespace, kust.Resources

	files, err := filepath.Glob(filepath.Join(deployDir, "*.yaml"))
	require.NoError(t, err)
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(b), -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			var meta struct {
				Kind string `json:"kind"`
			}
			require.NoError(t, yaml.Unmarshal([]byte(doc), &meta))
			var into any
			switch meta.Kind {
			case "ServiceAccount":
				d.account = &corev1.ServiceAccount{}
				into = d.account
			case "ClusterRole":
				d.role = &rbacv1.ClusterRole{}
				into = d.role
			case "ClusterRoleBinding":
				d.binding = &rbacv1.ClusterRoleBinding{}
				into = d.binding
			case "Service":
				d.service = &corev1.Service{}
				into = d.service
			case "Deployment":
				d.deployment = &appsv1.Deployment{}
				into = d.deployment
			case "KubeSchedulerConfiguration":
				d.scheduler = &configv1.KubeSchedulerConfiguration{}
				into = d.scheduler
			default:
				t.Fatalf("%s document %d: unexpected kind %q", f, i, meta.Kind)
			}
			require.NoError(t, yaml.UnmarshalStrict([]byte(doc), into), "%s document %d", f, i)
		}
	}
	require.NotNil(t, d.account)
	require.NotNil(t, d.role)
	require.NotNil(t, d.binding)
	require.NotNil(t, d.service)
	require.NotNil(t, d.deployment)
	require.NotNil(t, d.scheduler)
	return d
}

// TestDeployFiles keeps deploy/scheduler consistent: the scheduler calls the
// Service, which reaches the Deployment's port, which serves the verbs this
// package serves; the role reads nodes and nothing else.
func TestDeployFiles(t *testing.T) {
	t.Parallel()
	d := readDeploy(t)
	assert.Equal(t, "weightd-system", d.namespace)
	assert.ElementsMatch(t, []string{"rbac.yaml", "service.yaml", "deployment.yaml"}, d.kustomized)

	// kube-scheduler's configuration.
	s := d.scheduler
	assert.Equal(t, "kubescheduler.config.k8s.io/v1", s.APIVersion)
	require.Len(t, s.Extenders, 1)
	x := s.Extenders[0]
	u, err := url.Parse(x.URLPrefix)
	require.NoError(t, err)
	require.Len(t, d.service.Spec.Ports, 1)
	port := d.service.Spec.Ports[0]
	assert.Equal(t, fmt.Sprintf("%s.%s.svc:%d", d.service.Name, d.namespace, port.Port), u.Host, "urlPrefix names the Service")
	assert.Equal(t, VerbPrioritize, x.PrioritizeVerb)
	assert.Equal(t, VerbFilter, x.FilterVerb)
	assert.True(t, x.NodeCacheCapable, "nodenames mode")
	assert.True(t, x.Ignorable, "scheduling never blocks on the extender")
	assert.Positive(t, x.Weight)
	assert.Positive(t, x.HTTPTimeout.Duration)
	assert.Empty(t, x.BindVerb)
	assert.Empty(t, x.PreemptVerb)

	// The Service reaches the Deployment's named port.
	dep := d.deployment
	pod := dep.Spec.Template
	sel := labels.SelectorFromSet(d.service.Spec.Selector)
	assert.True(t, sel.Matches(labels.Set(pod.Labels)), "the Service selects the extender's pods")
	require.Len(t, pod.Spec.Containers, 1)
	c := pod.Spec.Containers[0]
	i := slices.IndexFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.Name == port.TargetPort.StrVal })
	require.GreaterOrEqual(t, i, 0, "the container names the Service's target port")
	assert.Contains(t, c.Args, fmt.Sprintf("--listen=:%d", c.Ports[i].ContainerPort))
	assert.Equal(t, "extender", c.Args[0])
	assert.Equal(t, "/readyz", c.ReadinessProbe.HTTPGet.Path)
	assert.Equal(t, "/healthz", c.LivenessProbe.HTTPGet.Path)
	assert.Equal(t, d.account.Name, pod.Spec.ServiceAccountName)
	assert.True(t, *pod.Spec.SecurityContext.RunAsNonRoot)
	assert.True(t, *c.SecurityContext.ReadOnlyRootFilesystem)
	assert.False(t, *c.SecurityContext.AllowPrivilegeEscalation)
	assert.Equal(t, []corev1.Capability{"ALL"}, c.SecurityContext.Capabilities.Drop)
	assert.NotEmpty(t, c.Resources.Limits.Memory().String())

	// Least privilege: read nodes, nothing else.
	assert.Equal(t, []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list", "watch"}}}, d.role.Rules)
	assert.Equal(t, d.role.Name, d.binding.RoleRef.Name)
	assert.Equal(t, []rbacv1.Subject{{Kind: "ServiceAccount", Name: d.account.Name, Namespace: d.namespace}}, d.binding.Subjects)
}

// TestDeployApply has a real API server accept deploy/scheduler
// (kubectl apply --dry-run=server -k), and checks that the extender's
// service account may watch nodes and may not read secrets or write nodes.
func TestDeployApply(t *testing.T) {
	t.Parallel()
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but no kubectl: %v", err)
		}
		t.Skipf("skipping: no kubectl: %v", err)
	}
	env := kubetest.NewT(t, kubetest.Config{})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	require.NoError(t, env.EnsureNamespace(ctx, "weightd-system"))
	k := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", env.Kubeconfig}, args...)...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		return out.String(), err
	}
	out, err := k("apply", "--dry-run=server", "-k", deployDir)
	require.NoError(t, err, out)
	for _, obj := range []string{"serviceaccount/weightd-extender", "clusterrole.rbac.authorization.k8s.io/weightd-extender", "clusterrolebinding.rbac.authorization.k8s.io/weightd-extender", "service/weightd-extender", "deployment.apps/weightd-extender"} {
		assert.Contains(t, out, obj)
	}
	out, err = k("apply", "-k", deployDir)
	require.NoError(t, err, out)
	as := "--as=system:serviceaccount:weightd-system:weightd-extender"
	for _, verb := range []string{"get", "list", "watch"} {
		out, err = k("auth", "can-i", verb, "nodes", as)
		assert.NoError(t, err, "%s nodes: %s", verb, out)
	}
	for _, denied := range [][]string{{"patch", "nodes"}, {"get", "secrets", "-A"}, {"list", "pods", "-A"}} {
		out, _ = k(append([]string{"auth", "can-i"}, append(denied, as)...)...)
		// kubectl may warn first (nodes are not namespaced).
		assert.True(t, strings.HasSuffix(strings.TrimSpace(out), "\nno") || strings.TrimSpace(out) == "no", "%v: %s", denied, out)
	}
}
