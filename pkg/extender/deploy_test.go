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

// decodeFile parses each document of a YAML file strictly into the real
// type of its kind.
func decodeFile(t *testing.T, f string) []any {
	t.Helper()
	b, err := os.ReadFile(f)
	require.NoError(t, err)
	var objs []any
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
			into = &corev1.ServiceAccount{}
		case "ClusterRole":
			into = &rbacv1.ClusterRole{}
		case "ClusterRoleBinding":
			into = &rbacv1.ClusterRoleBinding{}
		case "Role":
			into = &rbacv1.Role{}
		case "RoleBinding":
			into = &rbacv1.RoleBinding{}
		case "Service":
			into = &corev1.Service{}
		case "Deployment":
			into = &appsv1.Deployment{}
		case "KubeSchedulerConfiguration":
			into = &configv1.KubeSchedulerConfiguration{}
		default:
			t.Fatalf("%s document %d: unexpected kind %q", f, i, meta.Kind)
		}
		require.NoError(t, yaml.UnmarshalStrict([]byte(doc), into), "%s document %d", f, i)
		objs = append(objs, into)
	}
	return objs
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
		for _, obj := range decodeFile(t, f) {
			switch o := obj.(type) {
			case *corev1.ServiceAccount:
				d.account = o
			case *rbacv1.ClusterRole:
				d.role = o
			case *rbacv1.ClusterRoleBinding:
				d.binding = o
			case *corev1.Service:
				d.service = o
			case *appsv1.Deployment:
				d.deployment = o
			case *configv1.KubeSchedulerConfiguration:
				d.scheduler = o
			default:
				t.Fatalf("%s: unexpected %T", f, obj)
			}
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

	// The second scheduler calls the same extender the same way, in its
	// own profile, and mounts its configuration where it reads it.
	second := filepath.Join(deployDir, "second-scheduler")
	cfgs := decodeFile(t, filepath.Join(second, "config.yaml"))
	require.Len(t, cfgs, 1)
	cfg := cfgs[0].(*configv1.KubeSchedulerConfiguration)
	assert.Equal(t, s.Extenders, cfg.Extenders)
	require.Len(t, cfg.Profiles, 1)
	assert.Equal(t, "weightd-scheduler", *cfg.Profiles[0].SchedulerName)
	assert.Equal(t, "weightd-scheduler", cfg.LeaderElection.ResourceName)
	var roles, bindings int
	for _, obj := range decodeFile(t, filepath.Join(second, "rbac.yaml")) {
		switch o := obj.(type) {
		case *rbacv1.Role:
			roles++
			assert.Contains(t, o.Rules, rbacv1.PolicyRule{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, ResourceNames: []string{cfg.LeaderElection.ResourceName}, Verbs: []string{"get", "update"}})
		case *rbacv1.RoleBinding, *rbacv1.ClusterRoleBinding:
			bindings++
		}
	}
	assert.Equal(t, 1, roles)
	assert.Equal(t, 4, bindings)
	deps := decodeFile(t, filepath.Join(second, "deployment.yaml"))
	require.Len(t, deps, 1)
	sc := deps[0].(*appsv1.Deployment).Spec.Template.Spec.Containers[0]
	assert.Contains(t, sc.Command, "--config=/etc/weightd-scheduler/config.yaml")
	assert.Equal(t, "/etc/weightd-scheduler", sc.VolumeMounts[0].MountPath)
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
	out, err = k("apply", "--dry-run=server", "-k", filepath.Join(deployDir, "second-scheduler"))
	require.NoError(t, err, out)
	assert.Contains(t, out, "deployment.apps/weightd-scheduler")
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
