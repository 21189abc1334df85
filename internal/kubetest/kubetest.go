package kubetest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/retry"

	"github.com/weightd/weightd/internal/freeport"
)

// Config says how to start an Env. The zero Config is a fine default: an
// API server on a free port of 127.0.0.1 with its data in a temporary
// directory.
type Config struct {
	// Dir holds etcd's data, the certificates, the kubeconfig files and
	// the processes' logs (etcd.log, kube-apiserver.log). Empty means a new
	// temporary directory, removed by Close; a given Dir is left in place
	// (Start begins with fresh certificates and an empty etcd in it).
	Dir string

	// BindAddress is the IP address the API server listens on (its
	// --bind-address and --advertise-address). Empty means 127.0.0.1.
	BindAddress string

	// Port is the API server's secure port. 0 picks a free one.
	Port int

	// Netns, when set, also serves the API inside that network namespace
	// (a name under /run/netns, as `ip netns` and testbed.Host.NS name
	// them) at NetnsAddr and the same port, through a TCP forwarder in
	// this process, so that processes in a testbed's namespaces reach the
	// API server at an address of theirs (Env.NetnsHost and
	// Env.NetnsKubeconfig). The serving certificate names NetnsAddr.
	// Entering a namespace needs root (CAP_SYS_ADMIN).
	Netns     string
	NetnsAddr string

	// APIServerArgs are more kube-apiserver flags ("--name=value"); they
	// come after the defaults, so a repeated flag overrides a default.
	APIServerArgs []string

	// ControlPlane also runs kube-controller-manager and kube-scheduler,
	// as a cluster's control plane does, for tests that run real kubelets
	// (DaemonSets, service accounts, pod scheduling). The ServiceAccount
	// admission plugin is then on.
	ControlPlane bool

	// StartTimeout bounds how long Start and StartAPIServer wait for the
	// API server to be ready (besides the context). 0 means 90 seconds.
	StartTimeout time.Duration
}

// Env is a running etcd and kube-apiserver. Its methods are safe for
// concurrent use.
type Env struct {
	// Config is the admin's client configuration (a member of
	// system:masters, allowed everything). The caller may copy it and
	// change the copy.
	Config *rest.Config
	// Kubeconfig is a kubeconfig file for the admin, for kubectl and
	// other processes.
	Kubeconfig string
	// Host is the API server's URL, https://ADDRESS:PORT.
	Host string
	// NetnsHost and NetnsKubeconfig are the URL and the admin's
	// kubeconfig file that work inside Config.Netns (and from the hosts
	// that route to Config.NetnsAddr); empty without Config.Netns.
	NetnsHost       string
	NetnsKubeconfig string
	// Dir is Config.Dir, or the temporary directory in its place.
	Dir string

	cfg       Config
	assets    string
	removeDir bool
	pki       *pki
	etcdURL   string
	port      int
	bind      string
	clientset *kubernetes.Clientset

	mu        sync.Mutex
	etcd      *proc
	apiserver *proc
	// controllers are kube-controller-manager and kube-scheduler, with
	// Config.ControlPlane.
	controllers []*proc
	fwd         *forwarder
	closed      bool
}

// Start starts etcd and kube-apiserver from the binaries that FindAssets
// finds, and returns once the API server is ready and its default
// namespace exists. ctx bounds the start only: the processes run until
// Close. On error nothing is left running.
func Start(ctx context.Context, cfg Config) (_ *Env, err error) {
	assets, err := FindAssets()
	if err != nil {
		return nil, err
	}
	if (cfg.Netns == "") != (cfg.NetnsAddr == "") {
		return nil, errors.New("kubetest: Netns and NetnsAddr go together")
	}
	e := &Env{cfg: cfg, assets: assets, Dir: cfg.Dir, bind: cfg.BindAddress}
	if e.bind == "" {
		e.bind = "127.0.0.1"
	}
	if net.ParseIP(e.bind) == nil {
		return nil, fmt.Errorf("kubetest: BindAddress %q is not an IP address", e.bind)
	}
	if e.Dir == "" {
		if e.Dir, err = os.MkdirTemp("", "weightd-kubetest-"); err != nil {
			return nil, err
		}
		e.removeDir = true
	} else if err := os.MkdirAll(e.Dir, 0o700); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			e.Close()
		}
	}()

	if e.pki, err = newPKI(e.Dir, []string{e.bind, cfg.NetnsAddr}); err != nil {
		return nil, fmt.Errorf("kubetest: %w", err)
	}
	// Ports picked free can be taken by another process before the daemon
	// binds them (tests run in parallel): pick again then.
	if err := retryPortClash(true, func() error {
		// A first try may have left its data behind, naming its ports.
		if err := os.RemoveAll(filepath.Join(e.Dir, "etcd")); err != nil {
			return err
		}
		return e.startEtcd(ctx)
	}); err != nil {
		return nil, err
	}
	if err := retryPortClash(cfg.Port == 0, func() error { return e.startAPIServerOnPort(ctx) }); err != nil {
		return nil, err
	}
	if err := e.waitDefaultNamespace(ctx); err != nil {
		return nil, err
	}
	if cfg.ControlPlane {
		if err := e.startControllers(ctx); err != nil {
			return nil, err
		}
	}
	if cfg.Netns != "" {
		addr := net.JoinHostPort(cfg.NetnsAddr, strconv.Itoa(e.port))
		f, err := listenForward(cfg.Netns, addr, net.JoinHostPort(e.bind, strconv.Itoa(e.port)))
		if err != nil {
			return nil, fmt.Errorf("kubetest: serving the API in %s: %w", cfg.Netns, err)
		}
		e.mu.Lock()
		e.fwd = f
		e.mu.Unlock()
		e.NetnsHost = "https://" + addr
		e.NetnsKubeconfig = filepath.Join(e.Dir, "kubeconfig-netns")
		if err := e.writeKubeconfig(e.NetnsKubeconfig, e.NetnsHost); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// startAPIServerOnPort picks the API server's port (Config.Port or a free
// one), makes the admin's client and kubeconfig for it and starts it.
func (e *Env) startAPIServerOnPort(ctx context.Context) (err error) {
	if e.port = e.cfg.Port; e.port == 0 {
		ports, perr := freeport.Ports(e.bind, 1)
		if perr != nil {
			return perr
		}
		e.port = ports[0]
	}
	e.Host = "https://" + net.JoinHostPort(e.bind, strconv.Itoa(e.port))
	e.Config = &rest.Config{
		Host: e.Host,
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   e.pki.caCert,
			CertData: e.pki.adminCert,
			KeyData:  e.pki.adminKey,
		},
		// Tests create objects quickly; client-go's default of 5 per
		// second would make them slow, not more faithful.
		QPS:   200,
		Burst: 400,
	}
	if e.clientset, err = kubernetes.NewForConfig(e.Config); err != nil {
		return err
	}
	e.Kubeconfig = filepath.Join(e.Dir, "kubeconfig")
	if err := e.writeKubeconfig(e.Kubeconfig, e.Host); err != nil {
		return err
	}
	return e.StartAPIServer(ctx)
}

// retryPortClash runs start again, up to four times, while it fails because
// a port it picked was taken meanwhile; only when ports are picked.
func retryPortClash(picked bool, start func() error) error {
	for attempt := 1; ; attempt++ {
		err := start()
		if err == nil || !picked || attempt == 4 || !strings.Contains(err.Error(), "address already in use") {
			return err
		}
	}
}

// Clientset returns a clientset for the admin.
func (e *Env) Clientset() *kubernetes.Clientset { return e.clientset }

// StopAPIServer stops kube-apiserver and waits for it to exit; etcd and
// its data stay. The API server stops as a real one going away does: it
// stops listening, ends open watches within a second and finishes open
// requests (SIGTERM; SIGKILL if it has not exited after ten seconds).
// Clients see their watches end and then connections refused. It does
// nothing when the API server is not running.
func (e *Env) StopAPIServer() error {
	e.mu.Lock()
	p := e.apiserver
	e.apiserver = nil
	e.mu.Unlock()
	if p == nil {
		return nil
	}
	return p.stop()
}

// StartAPIServer starts kube-apiserver on the same address, port,
// certificates and etcd as before, and returns once it is ready. Clients
// made from Config before reconnect to it. It is an error to start it while
// it runs.
func (e *Env) StartAPIServer(ctx context.Context) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return errors.New("kubetest: environment closed")
	}
	if e.apiserver != nil {
		e.mu.Unlock()
		return errors.New("kubetest: the API server is running")
	}
	p, err := startProc(filepath.Join(e.assets, apiserverBin), e.apiserverArgs(), filepath.Join(e.Dir, "kube-apiserver.log"))
	if err != nil {
		e.mu.Unlock()
		return fmt.Errorf("kubetest: starting kube-apiserver: %w", err)
	}
	e.apiserver = p
	e.mu.Unlock()

	if err := e.waitReady(ctx, p); err != nil {
		return errors.Join(err, e.StopAPIServer())
	}
	return nil
}

// Close stops the API server, the forwarder and etcd, and removes Dir if
// Start created it. It is safe to call more than once.
func (e *Env) Close() error {
	e.mu.Lock()
	e.closed = true
	api, etcd, fwd, controllers := e.apiserver, e.etcd, e.fwd, e.controllers
	e.apiserver, e.etcd, e.fwd, e.controllers = nil, nil, nil, nil
	e.mu.Unlock()
	var errs []error
	for _, p := range controllers {
		errs = append(errs, p.stop())
	}
	if fwd != nil {
		fwd.close()
	}
	if api != nil {
		errs = append(errs, api.stop())
	}
	if etcd != nil {
		errs = append(errs, etcd.stop())
	}
	if e.removeDir && e.Dir != "" {
		errs = append(errs, os.RemoveAll(e.Dir))
	}
	return errors.Join(errs...)
}

func (e *Env) apiserverArgs() []string {
	args := []string{
		"--etcd-servers=" + e.etcdURL,
		"--bind-address=" + e.bind,
		"--advertise-address=" + e.bind,
		// The endpoints of the kubernetes Service would be the advertise
		// address, which the reconciler refuses when it is loopback; no pod
		// runs here to use that Service.
		"--endpoint-reconciler-type=none",
		"--secure-port=" + strconv.Itoa(e.port),
		"--cert-dir=" + filepath.Join(e.Dir, "apiserver-certs"),
		"--tls-cert-file=" + e.pki.serveCertFile,
		"--tls-private-key-file=" + e.pki.serveKeyFile,
		"--client-ca-file=" + e.pki.caFile,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + e.pki.saPublicFile,
		"--service-account-signing-key-file=" + e.pki.saKeyFile,
		"--service-cluster-ip-range=10.0.0.0/24",
		// RBAC, so that roles are enforced for the service accounts
		// tests act as; Node for kubelet identities. The admin is a
		// member of system:masters and passes both.
		"--authorization-mode=Node,RBAC",
		"--allow-privileged=true",
		"--profiling=false",
		// On SIGTERM, end open watches within a second, as a real API
		// server going away does (without it, an open watch holds the
		// shutdown until StopAPIServer's SIGKILL ten seconds later).
		"--shutdown-watch-termination-grace-period=1s",
	}
	if !e.cfg.ControlPlane {
		// No controller manager runs, so no namespace gets its default
		// service account: the ServiceAccount admission plugin would
		// refuse every pod. (envtest does the same.)
		args = append(args, "--disable-admission-plugins=ServiceAccount")
	}
	return append(args, e.cfg.APIServerArgs...)
}

func (e *Env) startEtcd(ctx context.Context) error {
	ports, err := freeport.Ports("127.0.0.1", 2)
	if err != nil {
		return err
	}
	clientPort, peerPort := ports[0], ports[1]
	e.etcdURL = "http://127.0.0.1:" + strconv.Itoa(clientPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(peerPort)
	args := []string{
		"--name=kubetest",
		"--data-dir=" + filepath.Join(e.Dir, "etcd"),
		"--listen-client-urls=" + e.etcdURL,
		"--advertise-client-urls=" + e.etcdURL,
		"--listen-peer-urls=" + peerURL,
		"--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=kubetest=" + peerURL,
		// Test data need not survive a power cut.
		"--unsafe-no-fsync=true",
		"--log-level=warn",
	}
	p, err := startProc(filepath.Join(e.assets, etcdBin), args, filepath.Join(e.Dir, "etcd.log"))
	if err != nil {
		return fmt.Errorf("kubetest: starting etcd: %w", err)
	}
	e.mu.Lock()
	e.etcd = p
	e.mu.Unlock()

	ctx, cancel := e.startContext(ctx)
	defer cancel()
	client := &http.Client{Timeout: 2 * time.Second}
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.etcdURL+"/health", nil)
		if err != nil {
			return err
		}
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-p.done:
			return fmt.Errorf("kubetest: etcd exited: %v\n%s", p.err, p.logTail())
		case <-ctx.Done():
			return fmt.Errorf("kubetest: waiting for etcd: %w\n%s", ctx.Err(), p.logTail())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (e *Env) startContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d := e.cfg.StartTimeout
	if d == 0 {
		d = 90 * time.Second
	}
	return context.WithTimeout(ctx, d)
}

// waitReady polls /readyz until the API server says it is ready.
func (e *Env) waitReady(ctx context.Context, p *proc) error {
	ctx, cancel := e.startContext(ctx)
	defer cancel()
	rc := e.clientset.Discovery().RESTClient()
	var last error
	for {
		rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := rc.Get().AbsPath("/readyz").DoRaw(rctx)
		rcancel()
		if err == nil {
			return nil
		}
		last = err
		select {
		case <-p.done:
			return fmt.Errorf("kubetest: kube-apiserver exited: %v\n%s", p.err, p.logTail())
		case <-ctx.Done():
			return fmt.Errorf("kubetest: waiting for kube-apiserver: %w (last: %v)\n%s", ctx.Err(), last, p.logTail())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// waitDefaultNamespace waits for the API server's bootstrap controller to
// create the default namespace, which tests use at once.
func (e *Env) waitDefaultNamespace(ctx context.Context) error {
	ctx, cancel := e.startContext(ctx)
	defer cancel()
	for {
		_, err := e.clientset.CoreV1().Namespaces().Get(ctx, metav1.NamespaceDefault, metav1.GetOptions{})
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kubetest: waiting for the default namespace: %w (last: %v)", ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (e *Env) writeKubeconfig(path, host string) error {
	cfg := rest.CopyConfig(e.Config)
	cfg.Host = host
	return WriteKubeconfig(path, cfg)
}

// WriteKubeconfig writes a kubeconfig file for cfg (its host, CA, client
// certificate or bearer token), for a process or kubectl to act as cfg
// does: for example an agent started as a process with the configuration
// of ServiceAccountConfig. Set cfg.Host to Env.NetnsHost for a process in
// Config.Netns's testbed.
func WriteKubeconfig(path string, cfg *rest.Config) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["user"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: cfg.CertData,
		ClientKeyData:         cfg.KeyData,
		Token:                 cfg.BearerToken,
	}
	kc.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: "user", Namespace: metav1.NamespaceDefault}
	kc.CurrentContext = "kubetest"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("kubetest: writing %s: %w", path, err)
	}
	return nil
}

// CreateNode creates a Node named name with labels, as a kubelet would
// register it: Ready, with capacity (8 CPUs, 64 GiB, 110 pods), an
// InternalIP address and node info. No kubelet runs: pods bound to it stay
// Pending unless a test sets their status.
func (e *Env) CreateNode(ctx context.Context, name string, labels map[string]string) (*corev1.Node, error) {
	l := map[string]string{
		corev1.LabelHostname:   name,
		corev1.LabelOSStable:   "linux",
		corev1.LabelArchStable: "amd64",
	}
	for k, v := range labels {
		l[k] = v
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: l}}
	_, err := e.clientset.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("creating node %s: %w", name, err)
	}
	resources := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("8"),
		corev1.ResourceMemory: resource.MustParse("64Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
	}
	now := metav1.Now()
	status := corev1.NodeStatus{
		Capacity:    resources,
		Allocatable: resources,
		Phase:       corev1.NodeRunning,
		Conditions: []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: corev1.ConditionTrue,
			Reason: "KubeletReady", Message: "kubetest: no kubelet runs",
			LastHeartbeatTime: now, LastTransitionTime: now,
		}},
		Addresses: []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: "10.1.0." + strconv.Itoa(1+int(fnv32(name)%250))},
			{Type: corev1.NodeHostName, Address: name},
		},
		NodeInfo: corev1.NodeSystemInfo{
			KubeletVersion:          KubernetesVersion,
			ContainerRuntimeVersion: "containerd://2.4.2",
			OperatingSystem:         "linux",
			Architecture:            "amd64",
		},
	}
	// With a control plane running, its node controllers write the new
	// node too (taints, annotations), so a conflict is retried on the latest.
	var updated *corev1.Node
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		latest, err := e.clientset.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		latest.Status = status
		updated, err = e.clientset.CoreV1().Nodes().UpdateStatus(ctx, latest, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("setting the status of node %s: %w", name, err)
	}
	return updated, nil
}

// EnsureNamespace creates namespace name if it does not exist.
func (e *Env) EnsureNamespace(ctx context.Context, name string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	_, err := e.clientset.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating namespace %s: %w", name, err)
	}
	return nil
}

func fnv32(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

// proc is a started process whose output goes to a log file.
type proc struct {
	cmd  *exec.Cmd
	log  string
	done chan struct{} // closed when it has exited; err is then set
	err  error
}

func startProc(bin string, args []string, logPath string) (*proc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "--- %s %s\n", time.Now().Format(time.RFC3339), strings.Join(append([]string{bin}, args...), " "))
	cmd := exec.Command(bin, args...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	// Killed with its starter's thread, so that a killed test leaves no
	// etcd or API server behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proc{cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// stop sends SIGTERM, then SIGKILL after ten seconds, and waits.
func (p *proc) stop() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM) // it may have exited meanwhile: done says
	select {
	case <-p.done:
		return nil
	case <-time.After(10 * time.Second):
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	return nil
}

// logTail is the end of the process's log, for error messages.
func (p *proc) logTail() string {
	f, err := os.Open(p.log)
	if err != nil {
		return ""
	}
	defer f.Close()
	const n = 4096
	if fi, err := f.Stat(); err == nil && fi.Size() > n {
		if _, err := f.Seek(fi.Size()-n, io.SeekStart); err != nil {
			return ""
		}
	}
	b, _ := io.ReadAll(f)
	return string(b)
}

// ServiceAccountConfig returns a client configuration that authenticates as
// service account namespace/name with a token from the TokenRequest API
// (valid for an hour). When pod is not nil the token is bound to it, as
// the kubelet binds the tokens it mounts: the API server then puts the
// pod's node in the user's extra authentication.kubernetes.io/node-name,
// which admission policies can compare with the object a request changes.
func (e *Env) ServiceAccountConfig(ctx context.Context, namespace, name string, pod *corev1.Pod) (*rest.Config, error) {
	expiry := int64(3600)
	req := &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &expiry}}
	if pod != nil {
		req.Spec.BoundObjectRef = &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}
	}
	tr, err := e.clientset.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, req, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("requesting a token for service account %s/%s: %w", namespace, name, err)
	}
	cfg := rest.AnonymousClientConfig(e.Config)
	cfg.BearerToken = tr.Status.Token
	return cfg, nil
}
