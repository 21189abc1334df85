package deploy_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/test/deploy/manifests"
)

const (
	repoRoot = "../.."
	chart    = repoRoot + "/" + manifests.Chart
)

// everything is every optional feature of the chart on, with values unlike
// the defaults: what the chart renders with them must still hold together.
var everything = []string{
	"image.repository=registry.example:5000/weightd",
	"image.tag=e2e",
	"image.pullPolicy=Never",
	"image.pullSecrets={regcred}",
	"containerd.root=/tmp/e2e/containerd/root",
	"containerd.socket=/tmp/e2e/containerd/containerd.sock",
	"containerd.configPath=/tmp/e2e/containerd/certs.d",
	"cache.budgetPercent=50",
	"cache.budgetBytes=500GiB",
	"mirror.addr=127.0.0.1:15001",
	"mirror.registries={docker.io,127.0.0.1:5000,registry.example:5000}",
	"gossip.port=17946",
	"gossip.chunkPort=17947",
	"gossip.join={10.0.0.1:17946,10.0.0.2:17946}",
	"warm.dramBudget=200GiB",
	"warm.stageDir=/tmp/e2e/containerd/root/weightd/stage",
	"loadTrace.enabled=false",
	"csi.enabled=true",
	"csi.kubeletDir=/tmp/e2e/kubelet",
	"agent.metricsPort=19464",
	"agent.runDir=/tmp/e2e/run/weightd",
	"agent.fetchAllowCIDRs={127.0.0.1/32,fd00::/8}",
	"agent.credentialsFor[0].host=registry.example.com:5000",
	"agent.credentialsFor[0].namespaces={team-a,team-b}",
	"agent.credentialsFor[1].host=huggingface.co",
	"agent.credentialsFor[1].namespaces={*}",
	"agent.credentialsFor[2].host=s3://team-a-models",
	"agent.credentialsFor[2].namespaces={team-a}",
	"agent.s3.endpoint=http://minio.example:9000",
	"agent.s3.region=eu-west-3",
	"agent.s3.pathStyle=true",
	"agent.serviceAccountAnnotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::111122223333:role/weightd",
	"agent.extraArgs={--fast-gossip}",
	"agent.extraEnv[0].name=WEIGHTD_UPLOAD_TCP",
	"agent.extraEnv[0].value=",
	"agent.config.upload-limit=500MiB",
	"agent.config.origin-limits.hf=1GiB",
	"agent.nodeSelector.pool=gpu",
	"agent.priorityClassName=",
	"extender.enabled=true",
	"extender.scheduler=second",
	"monitoring.podMonitor.enabled=true",
	"monitoring.serviceMonitor.enabled=true",
	"monitoring.prometheusRule.enabled=true",
	"monitoring.dashboards.enabled=true",
	"monitoring.dashboards.namespace=grafana",
	"monitoring.release=prom",
	"cleanup.extraEnv[0].name=KUBERNETES_SERVICE_HOST",
	"cleanup.extraEnv[0].value=10.0.0.9",
}

// helmTemplate renders the chart as release weightd in weightd-system with
// the values set, and returns helm's output and error.
func helmTemplate(t *testing.T, set ...string) ([]byte, error) {
	t.Helper()
	helm := services.RequireHelm(t)
	args := []string{"template", manifests.Release, chart, "--namespace", manifests.Namespace}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	cmd := exec.CommandContext(t.Context(), helm, args...)
	cmd.Env = helmEnv(t)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%w: %s", err, stderr.Bytes())
	}
	return out, nil
}

// helmEnv keeps helm's caches and configuration in the test's directory.
func helmEnv(t *testing.T) []string {
	dir := t.TempDir()
	return append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(dir, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(dir, "config"),
		"HELM_DATA_HOME="+filepath.Join(dir, "data"),
	)
}

// rendered is a chart's rendering, each document parsed strictly into the
// type of its kind (an unknown or misspelt field is an error), by kind.
type rendered struct {
	docs        []manifests.Doc
	daemonSets  map[string]*appsv1.DaemonSet
	deployments map[string]*appsv1.Deployment
	jobs        map[string]*batchv1.Job
	configMaps  map[string]*corev1.ConfigMap
	secrets     map[string]*corev1.Secret
	csiDrivers  map[string]*storagev1.CSIDriver
	objects     []*unstructured.Unstructured // every document
}

func render(t *testing.T, set ...string) *rendered {
	t.Helper()
	out, err := helmTemplate(t, set...)
	if err != nil {
		t.Fatalf("helm template %v: %v", set, err)
	}
	docs, err := manifests.Split(out)
	if err != nil {
		t.Fatal(err)
	}
	r := &rendered{docs: docs, daemonSets: map[string]*appsv1.DaemonSet{}, deployments: map[string]*appsv1.Deployment{},
		jobs: map[string]*batchv1.Job{}, configMaps: map[string]*corev1.ConfigMap{}, secrets: map[string]*corev1.Secret{},
		csiDrivers: map[string]*storagev1.CSIDriver{}}
	for _, d := range docs {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(d.Body), &u.Object); err != nil {
			t.Fatalf("%s: %v", d.Source, err)
		}
		r.objects = append(r.objects, u)
		var into any
		switch u.GetKind() {
		case "DaemonSet":
			ds := &appsv1.DaemonSet{}
			r.daemonSets[u.GetName()], into = ds, ds
		case "Deployment":
			dep := &appsv1.Deployment{}
			r.deployments[u.GetName()], into = dep, dep
		case "Job":
			j := &batchv1.Job{}
			r.jobs[u.GetName()], into = j, j
		case "ConfigMap":
			cm := &corev1.ConfigMap{}
			r.configMaps[u.GetName()], into = cm, cm
		case "Secret":
			s := &corev1.Secret{}
			r.secrets[u.GetName()], into = s, s
		case "CSIDriver":
			d := &storagev1.CSIDriver{}
			r.csiDrivers[u.GetName()], into = d, d
		case "ServiceAccount":
			into = &corev1.ServiceAccount{}
		case "Service":
			into = &corev1.Service{}
		case "ClusterRole":
			into = &rbacv1.ClusterRole{}
		case "ClusterRoleBinding":
			into = &rbacv1.ClusterRoleBinding{}
		case "Role":
			into = &rbacv1.Role{}
		case "RoleBinding":
			into = &rbacv1.RoleBinding{}
		case "ValidatingAdmissionPolicy":
			into = &admissionv1.ValidatingAdmissionPolicy{}
		case "ValidatingAdmissionPolicyBinding":
			into = &admissionv1.ValidatingAdmissionPolicyBinding{}
		case "PodMonitor", "ServiceMonitor", "PrometheusRule":
			// The Prometheus Operator's kinds: no Go types here.
		default:
			t.Fatalf("%s: unexpected kind %q", d.Source, u.GetKind())
		}
		if into != nil {
			if err := yaml.UnmarshalStrict([]byte(d.Body), into); err != nil {
				t.Fatalf("%s (%s %s): %v", d.Source, u.GetKind(), u.GetName(), err)
			}
		}
	}
	return r
}

// TestChartLint: helm lint, and helm lint --strict, find nothing wrong
// with the defaults or with every optional feature on.
func TestChartLint(t *testing.T) {
	t.Parallel()
	helm := services.RequireHelm(t)
	env := helmEnv(t)
	var set []string
	for _, s := range everything {
		set = append(set, "--set", s)
	}
	for _, args := range [][]string{
		{"lint", chart},
		{"lint", "--strict", chart},
		append([]string{"lint", "--strict", chart}, set...),
	} {
		cmd := exec.CommandContext(t.Context(), helm, args...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("helm %s: %v\n%s", strings.Join(args[:2], " "), err, out)
			continue
		}
		if strings.Contains(string(out), "[WARNING]") || strings.Contains(string(out), "[ERROR]") {
			t.Errorf("helm %s:\n%s", strings.Join(args[:2], " "), out)
		}
	}
}

// checkPeerCA checks that the agent's arguments name the peer CA and that
// the Secret the chart made with Helm's genCA is kept across uninstall and
// is a CA the agent mints its certificate from.
func checkPeerCA(t *testing.T, args []string, s *corev1.Secret) {
	t.Helper()
	if !slices.Contains(args, "--peer-ca-file=/etc/weightd/peer-ca/ca.crt") || !slices.Contains(args, "--peer-ca-key-file=/etc/weightd/peer-ca/ca.key") {
		t.Errorf("args %v: want the peer CA's files", args)
	}
	if s == nil || s.Annotations["helm.sh/resource-policy"] != "keep" {
		t.Fatalf("peer CA Secret %+v: want one kept across uninstall", s)
	}
	dir := t.TempDir()
	f := peertls.Files{CA: filepath.Join(dir, "ca.crt"), Key: filepath.Join(dir, "ca.key")}
	if err := os.WriteFile(f.CA, s.Data["ca.crt"], 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(f.Key, s.Data["ca.key"], 0o600); err != nil {
		t.Fatal(err)
	}
	id, err := peertls.New("node-1", f)
	if err != nil {
		t.Fatalf("the chart's peer CA: %v", err)
	}
	if id.Certificate().Issuer.CommonName != "weightd peer CA" {
		t.Errorf("certificate issued by %q", id.Certificate().Issuer.CommonName)
	}
}

// TestChartDefaults renders the chart as `helm install` with no values
// would: the agent and its objects, a gossip Secret, the post-delete hook;
// no extender, no Prometheus Operator objects (a cluster without their
// CRDs installs it).
func TestChartDefaults(t *testing.T) {
	t.Parallel()
	r := render(t)
	kinds := map[string]int{}
	for _, o := range r.objects {
		kinds[o.GetKind()]++
		if ns := o.GetNamespace(); ns != "" && ns != manifests.Namespace {
			t.Errorf("%s %s in namespace %q, want the release's", o.GetKind(), o.GetName(), ns)
		}
		if o.GetLabels()["app.kubernetes.io/managed-by"] != "Helm" || o.GetLabels()["app.kubernetes.io/instance"] != manifests.Release {
			t.Errorf("%s %s labels %v lack Helm's", o.GetKind(), o.GetName(), o.GetLabels())
		}
	}
	for _, k := range []string{"PodMonitor", "ServiceMonitor", "PrometheusRule", "Deployment"} {
		if kinds[k] > 0 {
			t.Errorf("%d %s by default", kinds[k], k)
		}
	}
	ds := r.daemonSets["weightd"]
	if ds == nil {
		t.Fatalf("no DaemonSet weightd: %v", kinds)
	}
	c := ds.Spec.Template.Spec.Containers[0]
	if c.Image != "ghcr.io/weightd/weightd:0.1.0" || c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("image %s (%s), want the chart's appVersion", c.Image, c.ImagePullPolicy)
	}
	if !slices.Contains(c.Args, "--join-dns=weightd-gossip.weightd-system.svc.cluster.local") {
		t.Errorf("args %v: want --join-dns of the headless Service in the release's namespace", c.Args)
	}
	s := r.secrets["weightd-gossip"]
	if s == nil || s.Annotations["helm.sh/resource-policy"] != "keep" || len(s.Data["keys"]) < 32 {
		t.Errorf("gossip Secret %+v: want one kept across uninstall, with a key", s)
	}
	checkPeerCA(t, c.Args, r.secrets["weightd-peer-ca"])
	cfg := agentConfig(t, r.configMaps["weightd-config"])
	if err := checkLinkLayout(ds.Spec.Template.Spec, cfg, "/var/lib/containerd"); err != nil {
		t.Error(err)
	}
	checkCleanupHook(t, r, ds, "/etc/containerd/certs.d", "docker.io,ghcr.io,nvcr.io,registry.k8s.io")
	// No CSI driver: the agent stays unprivileged, away from the kubelet's
	// directory.
	if len(r.csiDrivers) > 0 || cfg["csi-endpoint"] != nil {
		t.Errorf("CSIDriver %v, csi-endpoint %v by default", r.csiDrivers, cfg["csi-endpoint"])
	}
	if sc := c.SecurityContext; sc == nil || sc.Privileged == nil || *sc.Privileged || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("security context %+v: want no privilege and no escalation", sc)
	}
	for _, m := range c.VolumeMounts {
		if m.MountPropagation != nil || strings.HasPrefix(m.MountPath, "/var/lib/kubelet") {
			t.Errorf("volumeMount %+v by default", m)
		}
	}
}

// TestChartCSI: csi.enabled makes the agent the node plugin of
// models.weightd.io at the kubelet directory given: the CSIDriver the
// kubelet looks the driver up by, the agent's sockets in that directory's
// plugins/ and plugins_registry/, and that directory mounted at its own
// path with Bidirectional propagation, which the API server accepts only
// in a privileged container; the cache's hard-link layout is unchanged.
func TestChartCSI(t *testing.T) {
	t.Parallel()
	const kubeletDir = "/var/lib/k0s/kubelet"
	r := render(t, "csi.enabled=true", "csi.kubeletDir="+kubeletDir+"/",
		"csi.allowedRefs[0].namespace=team-a", "csi.allowedRefs[0].prefixes={hf://org-a/,oci://registry.example/models}",
		"csi.allowedRefs[1].namespace=*", "csi.allowedRefs[1].prefixes={hf://public/}")
	d := r.csiDrivers["models.weightd.io"]
	if d == nil {
		t.Fatalf("no CSIDriver models.weightd.io: %v", r.csiDrivers)
	}
	if d.Spec.AttachRequired == nil || *d.Spec.AttachRequired || d.Spec.PodInfoOnMount == nil || !*d.Spec.PodInfoOnMount ||
		d.Spec.FSGroupPolicy == nil || *d.Spec.FSGroupPolicy != storagev1.NoneFSGroupPolicy ||
		!slices.Equal(d.Spec.VolumeLifecycleModes, []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecycleEphemeral, storagev1.VolumeLifecyclePersistent}) {
		t.Errorf("CSIDriver spec %+v: want no attach, pod info on mount, no fsGroup changes, ephemeral and persistent volumes", d.Spec)
	}
	cfg := agentConfig(t, r.configMaps["weightd-config"])
	for k, want := range map[string]string{
		"csi-endpoint":             "unix://" + kubeletDir + "/plugins/models.weightd.io/csi.sock",
		"kubelet-registration-dir": kubeletDir + "/plugins_registry",
		"kubelet-dir":              kubeletDir,
	} {
		if cfg[k] != want {
			t.Errorf("config %s = %#v, want %q", k, cfg[k], want)
		}
	}
	// The agent's own parser reads the allowlist as the values say.
	allow, err := csi.ParseAllowlist(fmt.Sprint(cfg["csi-allowed-refs"]))
	if err != nil {
		t.Fatalf("csi-allowed-refs %v: %v", cfg["csi-allowed-refs"], err)
	}
	for _, tc := range []struct {
		ns, ref string
		ok      bool
	}{
		{"team-a", "hf://org-a/model@main", true},
		{"team-a", "oci://registry.example/models/llm:v1", true},
		{"team-b", "hf://public/model@main", true},
		{"team-b", "hf://org-a/model@main", false},
	} {
		if err := allow.Check(tc.ns, tc.ref); (err == nil) != tc.ok {
			t.Errorf("namespace %s, %s: %v, want allowed %v", tc.ns, tc.ref, err, tc.ok)
		}
	}
	ds := r.daemonSets["weightd"]
	if ds == nil {
		t.Fatal("no DaemonSet weightd")
	}
	spec := ds.Spec.Template.Spec
	c := spec.Containers[0]
	if err := checkLinkLayout(spec, cfg, "/var/lib/containerd"); err != nil {
		t.Error(err)
	}
	m := mountFor(c, kubeletDir+"/plugins_registry")
	if m == nil || m.MountPath != kubeletDir || m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional || m.ReadOnly {
		t.Fatalf("the kubelet's directory is mounted as %+v: want %s, writable, Bidirectional", m, kubeletDir)
	}
	for _, v := range spec.Volumes {
		if v.Name == m.Name && (v.HostPath == nil || v.HostPath.Path != kubeletDir || v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectory) {
			t.Errorf("volume %s: %+v, want the host's %s, which must exist", v.Name, v.VolumeSource, kubeletDir)
		}
	}
	if sc := c.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged || (sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation) {
		t.Errorf("security context %+v: Bidirectional propagation needs a privileged container", sc)
	}
}

// TestChartEverything renders every optional feature, with the values the
// end-to-end test gives (an image imported into containerd, containerd's
// paths under a test directory, explicit gossip peers, loopback
// registries), and checks that each one lands where it should.
func TestChartEverything(t *testing.T) {
	t.Parallel()
	r := render(t, everything...)
	ds := r.daemonSets["weightd"]
	if ds == nil {
		t.Fatal("no DaemonSet weightd")
	}
	spec := ds.Spec.Template.Spec
	c := spec.Containers[0]

	// Every container of weightd's image, the hook's included, takes the
	// image values.
	for _, o := range r.objects {
		for _, path := range [][]string{{"spec", "template", "spec", "containers"}, {"spec", "template", "spec", "initContainers"}} {
			cs, _, _ := unstructured.NestedSlice(o.Object, path...)
			for _, x := range cs {
				m := x.(map[string]any)
				if strings.HasPrefix(m["image"].(string), "registry.k8s.io/kube-scheduler:") {
					continue
				}
				if m["image"] != "registry.example:5000/weightd:e2e" || m["imagePullPolicy"] != "Never" {
					t.Errorf("%s %s container %s: image %v (%v)", o.GetKind(), o.GetName(), m["name"], m["image"], m["imagePullPolicy"])
				}
			}
			if len(cs) > 0 && path[len(path)-1] == "containers" {
				secrets, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "imagePullSecrets")
				if len(secrets) != 1 && !strings.HasSuffix(o.GetName(), "-scheduler") {
					t.Errorf("%s %s: imagePullSecrets %v", o.GetKind(), o.GetName(), secrets)
				}
			}
		}
	}

	cfg := agentConfig(t, r.configMaps["weightd-config"])
	if err := checkLinkLayout(spec, cfg, "/tmp/e2e/containerd/root"); err != nil {
		t.Error(err)
	}
	for k, want := range map[string]any{
		"root":               "/tmp/e2e/containerd/root/weightd",
		"containerd-address": "/tmp/e2e/containerd/containerd.sock",
		"hosts-dir":          "/tmp/e2e/containerd/certs.d",
		"mirror-addr":        "127.0.0.1:15001",
		"mirror-registries":  "docker.io,127.0.0.1:5000,registry.example:5000",
		"budget-percent":     float64(50),
		"budget-bytes":       "500GiB",
		"gossip-addr":        "0.0.0.0:17946",
		"chunk-addr":         "0.0.0.0:17947",
		"metrics-addr":       "0.0.0.0:19464",
		"api":                "unix:///tmp/e2e/run/weightd/weightd.sock",
		"upload-limit":       "500MiB",
		"fetch-allow-cidrs":  "127.0.0.1/32,fd00::/8",
		"agent-credentials":  "registry.example.com:5000=team-a;team-b,huggingface.co=*,s3://team-a-models=team-a",
		"s3-endpoint":        "http://minio.example:9000",
		"s3-region":          "eu-west-3",
		"s3-path-style":      true,
	} {
		if cfg[k] != want {
			t.Errorf("config %s = %#v, want %#v", k, cfg[k], want)
		}
	}
	if got, want := cfg["origin-limits"], map[string]any{"hf": "1GiB"}; !reflect.DeepEqual(got, want) {
		t.Errorf("config origin-limits = %#v, want %#v", got, want)
	}
	roles := 0
	for _, o := range r.objects {
		if o.GetKind() == "ServiceAccount" && o.GetAnnotations()["eks.amazonaws.com/role-arn"] == "arn:aws:iam::111122223333:role/weightd" {
			roles++
		}
	}
	if roles != 1 {
		t.Errorf("%d ServiceAccounts with the agent's IRSA role, want 1 (the agent's)", roles)
	}
	if !slices.Contains(c.Args, "--join=10.0.0.1:17946,10.0.0.2:17946") || slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--join-dns") }) {
		t.Errorf("args %v: want --join with the explicit peers and no --join-dns", c.Args)
	}
	if !slices.Contains(c.Args, "--fast-gossip") {
		t.Errorf("args %v lack the extra one", c.Args)
	}
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	for k, want := range map[string]string{
		"WEIGHTD_WARM_DRAM_BUDGET": "200GiB",
		"WEIGHTD_WARM_STAGE_DIR":   "/tmp/e2e/containerd/root/weightd/stage",
		"WEIGHTD_LOAD_TRACE":       "false",
		"WEIGHTD_UPLOAD_TCP":       "",
		"WEIGHTD_API":              "unix:///tmp/e2e/run/weightd/weightd.sock",
	} {
		if v, ok := env[k]; !ok || v != want {
			t.Errorf("env %s = %q (set: %v), want %q", k, v, ok, want)
		}
	}
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.HostPort
	}
	if ports["gossip-tcp"] != 17946 || ports["gossip-udp"] != 17946 || ports["chunks"] != 17947 || ports["metrics"] != 19464 {
		t.Errorf("host ports %v", ports)
	}
	if spec.NodeSelector["pool"] != "gpu" || spec.PriorityClassName != "" {
		t.Errorf("nodeSelector %v priorityClassName %q", spec.NodeSelector, spec.PriorityClassName)
	}
	checkCleanupHook(t, r, ds, "/tmp/e2e/containerd/certs.d", "docker.io,127.0.0.1:5000,registry.example:5000")
	job := r.jobs["weightd-cleanup-wait"]
	if job == nil || !slices.Contains(job.Spec.Template.Spec.Containers[0].Env, corev1.EnvVar{Name: "KUBERNETES_SERVICE_HOST", Value: "10.0.0.9"}) {
		t.Errorf("the cleanup Job lacks cleanup.extraEnv")
	}

	// The extender and a second scheduler that calls it.
	for _, name := range []string{"weightd-extender", "weightd-scheduler"} {
		if r.deployments[name] == nil {
			t.Errorf("no Deployment %s", name)
		}
	}
	if cm := r.configMaps["weightd-scheduler-config"]; cm == nil || !strings.Contains(cm.Data["config.yaml"], "urlPrefix: http://weightd-extender.weightd-system.svc:8888") {
		t.Errorf("the second scheduler's config does not call the extender: %v", cm)
	}
	// The Prometheus Operator's objects and the dashboard, with the
	// release label kube-prometheus-stack selects by.
	kinds := map[string]*unstructured.Unstructured{}
	for _, o := range r.objects {
		kinds[o.GetKind()] = o
	}
	for _, k := range []string{"PodMonitor", "ServiceMonitor", "PrometheusRule"} {
		if o := kinds[k]; o == nil || o.GetLabels()["release"] != "prom" {
			t.Errorf("%s: %v, want one labelled release=prom", k, o)
		}
	}
	dash := r.configMaps["weightd-dashboards"]
	if dash == nil || dash.Namespace != "grafana" || dash.Labels["grafana_dashboard"] != "1" || dash.Labels["release"] != "prom" {
		t.Errorf("dashboards ConfigMap %v: want it in grafana, labelled grafana_dashboard=1", dash)
	} else {
		want, err := os.ReadFile(filepath.Join(chart, "dashboards", "weightd-cold-start.json"))
		if err != nil {
			t.Fatal(err)
		}
		if dash.Data["weightd-cold-start.json"] != string(want) {
			t.Error("the dashboards ConfigMap does not hold dashboards/weightd-cold-start.json as it is")
		}
	}
}

// TestChartClusterScheduler: extender.scheduler=cluster renders the
// extender entry for the control plane's scheduler, and no second one.
func TestChartClusterScheduler(t *testing.T) {
	t.Parallel()
	r := render(t, "extender.enabled=true", "extender.scheduler=cluster")
	if r.deployments["weightd-extender"] == nil || r.deployments["weightd-scheduler"] != nil {
		t.Errorf("Deployments %v: want the extender alone", r.deployments)
	}
	cm := r.configMaps["weightd-scheduler-extender"]
	if cm == nil || !strings.Contains(cm.Data["scheduler-config.yaml"], "kind: KubeSchedulerConfiguration") {
		t.Errorf("no scheduler configuration to merge: %v", cm)
	}
}

// TestChartBadValues: a value that makes no sense fails helm template with
// a message that names it.
func TestChartBadValues(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		set  []string
		want string
	}{
		{[]string{"cache.budgetPercent=0"}, "at '/cache/budgetPercent': minimum: got 0, want 1"},
		{[]string{"cache.budgetPercent=120"}, "at '/cache/budgetPercent': maximum: got 120, want 100"},
		{[]string{"cache.budgetBytes=lots"}, `cache.budgetBytes "lots" is not a size`},
		{[]string{"warm.dramBudget=2 parsecs"}, `warm.dramBudget "2 parsecs" is not a size`},
		{[]string{"image.pullPolicy=Sometimes"}, "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"},
		{[]string{"image.repository="}, "at '/image/repository'"},
		{[]string{"mirror.registries={docker.io,https://ghcr.io}"}, `mirror.registries: "https://ghcr.io" is not a registry host[:port]`},
		{[]string{"mirror.registries={ghcr.io/org}"}, `mirror.registries: "ghcr.io/org" is not a registry host[:port]`},
		{[]string{"mirror.registries={Docker.IO}"}, `mirror.registries: "Docker.IO" is not a registry host[:port]`},
		{[]string{"mirror.registries=null"}, "mirror.enabled with no mirror.registries"},
		{[]string{"mirror.addr=localhost"}, `mirror.addr "localhost" is not a host:port`},
		{[]string{"mirror.registeries={docker.io}"}, "additional properties 'registeries' not allowed"},
		{[]string{"gossip.join={10.0.0.1}"}, `gossip.join: "10.0.0.1" is not a host:port`},
		{[]string{"agent.s3.endpoint=minio:9000"}, "at '/agent/s3/endpoint'"},
		{[]string{"agent.s3.pathstyle=true"}, "additional properties 'pathstyle' not allowed"},
		{[]string{"agent.credentialsFor[0].host=s3://Team_A", "agent.credentialsFor[0].namespaces={a}"}, "at '/agent/credentialsFor/0/host'"},
		{[]string{"gossip.port=70000"}, "at '/gossip/port': maximum"},
		{[]string{"gossip.chunkPort=9464"}, "gossip.chunkPort and agent.metricsPort are both port 9464"},
		{[]string{"mirror.addr=127.0.0.1:7946"}, "gossip.port and mirror.addr are both port 7946"},
		{[]string{"gossip.existingSecret=My_Secret"}, `gossip.existingSecret "My_Secret" is not a Secret name`},
		{[]string{"peerTLS.existingSecret=My_CA"}, `peerTLS.existingSecret "My_CA" is not a Secret name`},
		{[]string{"peerTLS.certLifetime=1day"}, "at '/peerTLS/certLifetime'"},
		{[]string{"peerTLS.caDays=0"}, "at '/peerTLS/caDays': minimum"},
		{[]string{"containerd.root=var/lib/containerd"}, `containerd.root "var/lib/containerd" is not an absolute path`},
		{[]string{"containerd.root=/"}, "containerd.root is /"},
		{[]string{"containerd.socket=/run/../containerd.sock"}, "containerd.socket \"/run/../containerd.sock\": give a clean absolute path"},
		{[]string{"warm.stageDir=/var/lib/weightd/adapters"}, `warm.stageDir "/var/lib/weightd/adapters" is not inside containerd.root`},
		{[]string{"loadTrace.mount=models"}, `loadTrace.mount "models" is not an absolute path`},
		{[]string{"csi.enabled=true", "csi.kubeletDir=var/lib/kubelet"}, `csi.kubeletDir "var/lib/kubelet" is not an absolute path`},
		{[]string{"csi.enabled=true", "csi.kubeletDir=/"}, "csi.kubeletDir is /"},
		{[]string{"csi.kubeletDir=/var/lib/../kubelet"}, `csi.kubeletDir "/var/lib/../kubelet": give a clean absolute path`},
		{[]string{"csi.kubeletDir="}, "at '/csi/kubeletDir'"},
		{[]string{"csi.enabled=yes"}, "at '/csi/enabled': got string, want boolean"},
		{[]string{"csi.driver=models.example.com"}, "additional properties 'driver' not allowed"},
		{[]string{"agent.config.csi-endpoint=unix:///tmp/csi.sock"}, "agent.config.csi-endpoint is set by the chart"},
		{[]string{"csi.allowedRefs[0].namespace=Team_A", "csi.allowedRefs[0].prefixes={*}"}, "at '/csi/allowedRefs/0/namespace'"},
		{[]string{"csi.allowedRefs[0].namespace=team-a", "csi.allowedRefs[0].prefixes={hf://a;b}"}, "at '/csi/allowedRefs/0/prefixes/0'"},
		{[]string{"csi.allowedRefs[0].namespace=team-a"}, "at '/csi/allowedRefs/0'"},
		{[]string{"agent.logFormat=xml"}, "at '/agent/logFormat': value must be one of 'text', 'json'"},
		{[]string{"agent.config.root=/data"}, "agent.config.root is set by the chart"},
		{[]string{"agent.fetchAllowCIDRs={metadata.internal}"}, "at '/agent/fetchAllowCIDRs/0'"},
		{[]string{"agent.credentialsFor[0].host=ghcr.io", "agent.credentialsFor[0].namespaces={Team_A}"}, "at '/agent/credentialsFor/0/namespaces/0'"},
		{[]string{"agent.credentialsFor[0].host=ghcr.io"}, "at '/agent/credentialsFor/0'"},
		{[]string{"extender.enabled=true"}, "extender.enabled needs a scheduler that calls it: set extender.scheduler=cluster"},
		{[]string{"extender.enabled=true", "extender.scheduler=both"}, "at '/extender/scheduler': value must be one of"},
		{[]string{"monitoring.podMonitor.interval=30"}, "at '/monitoring/podMonitor/interval'"},
	} {
		_, err := helmTemplate(t, tc.set...)
		if err == nil {
			t.Errorf("helm template --set %v: no error, want %q", tc.set, tc.want)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("helm template --set %v:\n%v\nwant %q", tc.set, err, tc.want)
		}
	}
}

// TestManifestsUpToDate: deploy/ is what the chart renders (make
// manifests), so the kustomize deployment and the chart cannot drift.
func TestManifestsUpToDate(t *testing.T) {
	t.Parallel()
	helm := services.RequireHelm(t)
	files, err := manifests.Render(t.Context(), helm, repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	if err := manifests.Check(repoRoot, files); err != nil {
		t.Errorf("%v\nrun `make manifests`", err)
	}
	// Check finds a file that differs, and one rendered from nothing.
	root := t.TempDir()
	if err := manifests.Write(root, files); err != nil {
		t.Fatal(err)
	}
	for _, f := range manifests.HandWritten {
		if err := os.WriteFile(filepath.Join(root, f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := manifests.Check(root, files); err != nil {
		t.Fatalf("a fresh rendering: %v", err)
	}
	ds := filepath.Join(root, "deploy", "daemonset", "daemonset.yaml")
	b, _ := os.ReadFile(ds)
	if err := os.WriteFile(ds, bytes.Replace(b, []byte("maxSurge: 0"), []byte("maxSurge: 1"), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "deploy", "scheduler", "extra.yaml"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	err = manifests.Check(root, files)
	for _, want := range []string{"deploy/daemonset/daemonset.yaml differs", "deploy/scheduler/extra.yaml is rendered from nothing"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Check on an edited copy: %v, want %q", err, want)
		}
	}
	if !errors.Is(err, manifests.ErrStale) {
		t.Errorf("%v is not ErrStale", err)
	}
}

// TestKustomizeLinkLayout: the kustomize DaemonSet (deploy/daemonset, as
// the chart renders it with default values) mounts containerd's root at its
// host path, with the cache inside it.
func TestKustomizeLinkLayout(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(filepath.Join(kustomize, "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict(b, &ds); err != nil {
		t.Fatal(err)
	}
	b, err = os.ReadFile(filepath.Join(kustomize, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := checkLinkLayout(ds.Spec.Template.Spec, parseAgentConfig(t, b), "/var/lib/containerd"); err != nil {
		t.Error(err)
	}
}

// TestKustomizeCSI: deploy/csi, built by kustomize over deploy/daemonset,
// is the chart's rendering with csi.enabled=true: the same CSIDriver, and
// the same DaemonSet once its patch is applied over the base's (which a
// strategic merge could get wrong: a list merged where it should be
// replaced, a field of the base left behind).
func TestKustomizeCSI(t *testing.T) {
	t.Parallel()
	kc := kubectl(t)
	out, err := exec.CommandContext(t.Context(), kc, "kustomize", repoRoot+"/deploy/csi").Output()
	if err != nil {
		t.Fatalf("kubectl kustomize deploy/csi: %v", err)
	}
	built := map[string]string{}
	for _, doc := range strings.Split(string(out), "\n---\n") {
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
			t.Fatal(err)
		}
		built[u.GetKind()+"/"+u.GetName()] = doc
	}
	r := render(t, "gossip.existingSecret="+manifests.GossipSecret, "peerTLS.existingSecret="+manifests.PeerCASecret, "csi.enabled=true")

	var gotDriver storagev1.CSIDriver
	if err := yaml.UnmarshalStrict([]byte(built["CSIDriver/models.weightd.io"]), &gotDriver); err != nil {
		t.Fatalf("the built CSIDriver: %v", err)
	}
	if !equalJSON(t, gotDriver.Spec, r.csiDrivers["models.weightd.io"].Spec) {
		t.Errorf("the built CSIDriver's spec %+v differs from the chart's", gotDriver.Spec)
	}

	var got appsv1.DaemonSet
	if err := yaml.UnmarshalStrict([]byte(built["DaemonSet/weightd"]), &got); err != nil {
		t.Fatalf("the built DaemonSet: %v", err)
	}
	want := r.daemonSets["weightd"].Spec.Template.Spec
	gotSpec := got.Spec.Template.Spec
	// kustomize names the generated ConfigMap with a hash of its contents.
	for i, v := range gotSpec.Volumes {
		if v.ConfigMap != nil && strings.HasPrefix(v.ConfigMap.Name, "weightd-config-") {
			name := v.ConfigMap.Name
			if cm := built["ConfigMap/"+name]; !strings.Contains(cm, "csi-endpoint: unix:///var/lib/kubelet/plugins/models.weightd.io/csi.sock") {
				t.Errorf("the built ConfigMap %s is not the CSI config:\n%s", name, cm)
			}
			gotSpec.Volumes[i].ConfigMap.Name = "weightd-config"
		}
	}
	if !equalJSON(t, gotSpec, want) {
		gy, _ := yaml.Marshal(gotSpec)
		wy, _ := yaml.Marshal(want)
		t.Errorf("kustomize build deploy/csi's DaemonSet pod spec differs from the chart's with csi.enabled:\n%s\nwant:\n%s", gy, wy)
	}
}

// TestLinkLayoutCheck: the check refuses the layouts in which no blob could
// be linked.
func TestLinkLayoutCheck(t *testing.T) {
	t.Parallel()
	hostPath := func(name, path string) corev1.Volume {
		return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: path}}}
	}
	good := corev1.PodSpec{
		Containers: []corev1.Container{{Name: "agent", VolumeMounts: []corev1.VolumeMount{{Name: "root", MountPath: "/var/lib/containerd"}}}},
		Volumes:    []corev1.Volume{hostPath("root", "/var/lib/containerd")},
	}
	cfg := map[string]any{"root": "/var/lib/containerd/weightd"}
	if err := checkLinkLayout(good, cfg, "/var/lib/containerd"); err != nil {
		t.Fatalf("the good layout: %v", err)
	}
	for name, tc := range map[string]struct {
		mutate func(*corev1.PodSpec, map[string]any)
		want   string
	}{
		"the old layout": {func(s *corev1.PodSpec, c map[string]any) {
			s.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "cache", MountPath: "/var/lib/weightd"}}
			s.Volumes = []corev1.Volume{hostPath("cache", "/var/lib/weightd")}
			c["root"] = "/var/lib/weightd"
		}, "content store /var/lib/containerd/io.containerd.content.v1.content is on no volumeMount"},
		"a mount over the cache": {func(s *corev1.PodSpec, c map[string]any) {
			s.Containers[0].VolumeMounts = append(s.Containers[0].VolumeMounts, corev1.VolumeMount{Name: "cache", MountPath: "/var/lib/containerd/weightd"})
			s.Volumes = append(s.Volumes, hostPath("cache", "/var/lib/containerd/weightd"))
		}, "not under one volumeMount"},
		"another path in the container": {func(s *corev1.PodSpec, c map[string]any) {
			s.Containers[0].VolumeMounts[0].MountPath = "/host/containerd"
			c["root"] = "/host/containerd/weightd"
		}, "containerd's content store"},
		"a sub-path": {func(s *corev1.PodSpec, c map[string]any) {
			s.Containers[0].VolumeMounts[0].SubPath = "x"
		}, "subPath"},
		"not a hostPath": {func(s *corev1.PodSpec, c map[string]any) {
			s.Volumes[0] = corev1.Volume{Name: "root", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}
		}, "not a hostPath"},
	} {
		s := good.DeepCopy()
		c := map[string]any{"root": cfg["root"]}
		tc.mutate(s, c)
		if err := checkLinkLayout(*s, c, "/var/lib/containerd"); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", name, err, tc.want)
		}
	}
}

// checkLinkLayout says why the agent's container in spec could not
// hard-link its cache's blobs into containerd's content store, or nil: the
// cache root (the config's root, unless WEIGHTD_ROOT or --root says
// otherwise) and containerd's content root
// (<containerdRoot>/io.containerd.content.v1.content, the path containerd
// names) must resolve under the same volumeMount, that mount must be a
// hostPath of containerd's root at the same path (containerd names the
// path as the host sees it), and the warm pool's stage directory must be
// on it too.
func checkLinkLayout(spec corev1.PodSpec, cfg map[string]any, containerdRoot string) error {
	c := spec.Containers[0]
	root, _ := cfg["root"].(string)
	for _, e := range c.Env {
		if e.Name == "WEIGHTD_ROOT" {
			root = e.Value
		}
	}
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--root="); ok {
			root = v
		}
	}
	if root == "" {
		return errors.New("no cache root in the config")
	}
	content := containerdRoot + "/io.containerd.content.v1.content"
	mc, mr := mountFor(c, content), mountFor(c, root)
	if mc == nil {
		return fmt.Errorf("containerd's content store %s is on no volumeMount", content)
	}
	if mr == nil || mr.MountPath != mc.MountPath {
		return fmt.Errorf("the cache %s and containerd's content store %s are not under one volumeMount (%v, %v): a hard link cannot cross mounts", root, content, mr, mc)
	}
	if mc.SubPath != "" || mc.SubPathExpr != "" {
		return fmt.Errorf("volumeMount %s has a subPath", mc.Name)
	}
	var vol *corev1.Volume
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == mc.Name {
			vol = &spec.Volumes[i]
		}
	}
	if vol == nil || vol.HostPath == nil {
		return fmt.Errorf("volume %s is not a hostPath", mc.Name)
	}
	if filepath.Clean(vol.HostPath.Path) != containerdRoot || filepath.Clean(mc.MountPath) != containerdRoot {
		return fmt.Errorf("volume %s mounts host path %s at %s: want containerd's root %s at its own path", mc.Name, vol.HostPath.Path, mc.MountPath, containerdRoot)
	}
	for _, e := range c.Env {
		if e.Name == "WEIGHTD_WARM_STAGE_DIR" {
			if m := mountFor(c, e.Value); m == nil || m.MountPath != mc.MountPath {
				return fmt.Errorf("the warm stage directory %s is not on the cache's mount %s", e.Value, mc.MountPath)
			}
		}
	}
	return nil
}

// mountFor returns the volumeMount that path is under in the container:
// the deepest one whose mountPath is path or a parent of it.
func mountFor(c corev1.Container, path string) *corev1.VolumeMount {
	path = filepath.Clean(path)
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		m := &c.VolumeMounts[i]
		mp := filepath.Clean(m.MountPath)
		if path == mp || strings.HasPrefix(path, strings.TrimSuffix(mp, "/")+"/") {
			if best == nil || len(mp) > len(filepath.Clean(best.MountPath)) {
				best = m
			}
		}
	}
	return best
}

// agentConfig returns the agent: section of the config.yaml in cm.
func agentConfig(t *testing.T, cm *corev1.ConfigMap) map[string]any {
	t.Helper()
	if cm == nil {
		t.Fatal("no agent ConfigMap")
	}
	return parseAgentConfig(t, []byte(cm.Data["config.yaml"]))
}

func parseAgentConfig(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var doc struct {
		Agent map[string]any `json:"agent"`
	}
	if err := yaml.UnmarshalStrict(b, &doc); err != nil {
		t.Fatal(err)
	}
	return doc.Agent
}

// checkCleanupHook checks the post-delete hook: a DaemonSet on the agent's
// nodes that restores the hosts dir of containerd for the registries, and a
// Job that waits for it; each a post-delete hook, in that order, deleted
// once it succeeds.
func checkCleanupHook(t *testing.T, r *rendered, agent *appsv1.DaemonSet, hostsDir, registries string) {
	t.Helper()
	ds, job := r.daemonSets["weightd-cleanup"], r.jobs["weightd-cleanup-wait"]
	if ds == nil || job == nil {
		t.Fatalf("the cleanup DaemonSet %v and Job %v", ds != nil, job != nil)
	}
	weights := map[string]string{}
	for _, o := range r.objects {
		if !strings.HasPrefix(o.GetName(), "weightd-cleanup") {
			continue
		}
		a := o.GetAnnotations()
		if a["helm.sh/hook"] != "post-delete" || a["helm.sh/hook-delete-policy"] != "before-hook-creation,hook-succeeded" {
			t.Errorf("%s %s annotations %v: want a post-delete hook deleted once it succeeds", o.GetKind(), o.GetName(), a)
		}
		weights[o.GetKind()] = a["helm.sh/hook-weight"]
	}
	if weights["ServiceAccount"] != "-1" || weights["Role"] != "-1" || weights["RoleBinding"] != "-1" || weights["DaemonSet"] != "0" || weights["Job"] != "1" {
		t.Errorf("hook weights %v: the account first, the DaemonSet, then the Job that waits for it", weights)
	}
	as, cs := agent.Spec.Template.Spec, ds.Spec.Template.Spec
	if !equalJSON(t, as.NodeSelector, cs.NodeSelector) || !equalJSON(t, as.Tolerations, cs.Tolerations) || !equalJSON(t, as.Affinity, cs.Affinity) {
		t.Error("the cleanup DaemonSet is not scheduled to the agent's nodes (nodeSelector, tolerations, affinity)")
	}
	if len(cs.InitContainers) != 1 || len(cs.Containers) != 1 {
		t.Fatalf("cleanup pod: %d init containers, %d containers", len(cs.InitContainers), len(cs.Containers))
	}
	restore := cs.InitContainers[0]
	for _, a := range []string{"restore-hosts", "--hosts-dir=" + hostsDir, "--registries=" + registries} {
		if !slices.Contains(restore.Args, a) {
			t.Errorf("restore args %v lack %s", restore.Args, a)
		}
	}
	if len(restore.VolumeMounts) != 1 || restore.VolumeMounts[0].MountPath != hostsDir {
		t.Errorf("restore mounts %v, want the hosts dir at its path", restore.VolumeMounts)
	}
	for _, v := range cs.Volumes {
		if v.HostPath == nil || v.HostPath.Path != hostsDir {
			t.Errorf("cleanup volume %v, want only the hosts dir", v)
		}
	}
	if got := cs.Containers[0].Args; !slices.Equal(got, []string{"restore-hosts", "--hold"}) {
		t.Errorf("cleanup container args %v", got)
	}
	wait := job.Spec.Template.Spec
	if !slices.Contains(wait.Containers[0].Args, "--wait-daemonset="+ds.Name) || wait.ServiceAccountName != "weightd-cleanup" || wait.RestartPolicy != corev1.RestartPolicyNever {
		t.Errorf("cleanup Job %+v: want it to wait for %s as weightd-cleanup", wait, ds.Name)
	}
	if job.Spec.ActiveDeadlineSeconds == nil {
		t.Error("the cleanup Job has no deadline")
	}
}

func equalJSON(t *testing.T, a, b any) bool {
	t.Helper()
	ja, err := yaml.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	jb, err := yaml.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(ja, jb)
}
