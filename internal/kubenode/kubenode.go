// Package kubenode runs a real Kubernetes node for tests: a kubelet
// registered with a kubetest API server, running pods on containerd 2.x's
// CRI with runc and the CNI bridge plugin, as root on this machine. With
// it, a DaemonSet is started by the kubelet's own means: images pulled
// through the CRI (and so through containerd's registry config_path),
// hostPath and Secret volumes mounted, probes run, containers restarted.
package kubenode

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/freeport"
	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/services"
)

// The host programs a node needs besides kubelet and containerd: Debian's
// runc and CNI plugins (packages runc and containernetworking-plugins).
const (
	RuncBinary = "/usr/sbin/runc"
	CNIBinDir  = "/usr/lib/cni"
)

// Config says how to start a Node.
type Config struct {
	// Name is the node's name. Required.
	Name string
	// Dir holds containerd's and the kubelet's state, configs and logs.
	// Required; it must be on a filesystem that supports overlayfs.
	Dir string
	// PodSubnet is the CIDR the bridge plugin gives pods addresses from.
	// Empty means 10.244.1.0/24.
	PodSubnet string
}

// Node is a running kubelet and its containerd.
type Node struct {
	// Name is Config.Name.
	Name string
	// Containerd is the node's container runtime; its Address, Root and
	// HostsDir are the host paths a DaemonSet mounts.
	Containerd *services.Containerd
	// Dir is Config.Dir.
	Dir string
	// KubeletDir is the kubelet's root directory (--root-dir), which holds
	// its plugins/ and plugins_registry/ and the pods' volumes. The kubelet
	// makes it a shared mount at start, so that a CSI node plugin's pod that
	// mounts it with Bidirectional propagation mounts the pods' volumes in
	// it.
	KubeletDir string

	env     *kubetest.Env
	bridge  string
	mu      sync.Mutex
	kubelet *exec.Cmd
	exited  chan struct{}
}

// Available says why a node cannot run here, or nil: it needs root, the
// kubelet built by kubetest's assets, containerd 2.x built by
// services.BuildContainerd, runc and the CNI plugins.
func Available() error {
	var errs []error
	if os.Geteuid() != 0 {
		errs = append(errs, errors.New("a kubelet needs root"))
	}
	if _, err := kubetest.Program(kubetest.KubeletBin); err != nil {
		errs = append(errs, err)
	}
	if _, err := services.CachedContainerd(services.Containerd2Version); err != nil {
		errs = append(errs, err)
	}
	for _, p := range []string{RuncBinary, filepath.Join(CNIBinDir, "bridge"), filepath.Join(CNIBinDir, "host-local"), filepath.Join(CNIBinDir, "loopback")} {
		if _, err := os.Stat(p); err != nil {
			errs = append(errs, fmt.Errorf("%s missing (apt-get install runc containernetworking-plugins)", p))
		}
	}
	return errors.Join(errs...)
}

// Start starts containerd with its CRI runtime configured, imports the
// sandbox (pause) image, starts the kubelet and waits until the node is
// Ready. Close stops it all and removes every pod's containers.
func Start(ctx context.Context, env *kubetest.Env, cfg Config) (_ *Node, err error) {
	if cfg.Name == "" || cfg.Dir == "" {
		return nil, errors.New("kubenode: Name and Dir are required")
	}
	if err := Available(); err != nil {
		return nil, err
	}
	if cfg.PodSubnet == "" {
		cfg.PodSubnet = "10.244.1.0/24"
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, err
	}
	n := &Node{Name: cfg.Name, Dir: dir, KubeletDir: filepath.Join(dir, "kubelet", "root"), env: env, bridge: "kn" + strconv.FormatUint(uint64(fnv32(cfg.Name)), 36)}
	defer func() {
		if err != nil {
			err = errors.Join(err, n.Close())
		}
	}()
	cni := filepath.Join(dir, "cni")
	if err := writeCNIConfig(cni, n.bridge, cfg.PodSubnet, filepath.Join(dir, "cni-ipam")); err != nil {
		return nil, err
	}
	bins, err := services.CachedContainerd(services.Containerd2Version)
	if err != nil {
		return nil, err
	}
	n.Containerd, err = services.StartContainerd(ctx, services.ContainerdConfig{
		Dir:         filepath.Join(dir, "containerd"),
		Binaries:    bins,
		ExtraConfig: runtimeConfig(cni),
	})
	if err != nil {
		return nil, fmt.Errorf("kubenode: %w", err)
	}
	if err := importPause(ctx, n); err != nil {
		return nil, err
	}
	if err := n.StartKubelet(ctx); err != nil {
		return nil, err
	}
	return n, nil
}

// runtimeConfig is the CRI runtime's part of containerd's config: runc by
// its path, cgroupfs (the kubelet's cgroup driver here), the CNI bridge,
// and the sandbox image importPause provides. Containers' oom_score_adj is
// kept no lower than containerd's own: the kubelet asks -998 for sandboxes,
// which a test machine whose root lacks CAP_SYS_RESOURCE refuses.
func runtimeConfig(cniConfDir string) string {
	return fmt.Sprintf(`  [plugins."io.containerd.cri.v1.runtime"]
    restrict_oom_score_adj = true
    [plugins."io.containerd.cri.v1.runtime".cni]
      bin_dirs = [%q]
      conf_dir = %q
      max_conf_num = 1
    [plugins."io.containerd.cri.v1.runtime".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
          BinaryName = %q
          SystemdCgroup = false
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %q
`, CNIBinDir, cniConfDir, RuncBinary, PauseImage)
}

// writeCNIConfig writes a bridge network: pods get addresses of subnet on
// bridge, with the bridge as their gateway. No masquerading (pods here
// only reach the node).
func writeCNIConfig(dir, bridge, subnet, ipamDir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	conf := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "kubenode",
  "plugins": [
    {
      "type": "bridge",
      "bridge": %q,
      "isGateway": true,
      "ipMasq": false,
      "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}
    },
    {"type": "loopback"}
  ]
}
`, bridge, ipamDir, subnet)
	return os.WriteFile(filepath.Join(dir, "10-kubenode.conflist"), []byte(conf), 0o644)
}

// StartKubelet starts the kubelet (again, after StopKubelet) and waits
// until its node is Ready.
func (n *Node) StartKubelet(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.kubelet != nil {
		return errors.New("kubenode: the kubelet runs")
	}
	bin, err := kubetest.Program(kubetest.KubeletBin)
	if err != nil {
		return err
	}
	kdir := filepath.Join(n.Dir, "kubelet")
	if err := os.MkdirAll(kdir, 0o755); err != nil {
		return err
	}
	cfg, err := n.env.UserConfig("system:node:"+n.Name, "system:nodes")
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(n.Dir, "kubelet.kubeconfig")
	if err := kubetest.WriteKubeconfig(kubeconfig, cfg); err != nil {
		return err
	}
	if err := makeCgroups(n.cgroupRoot()); err != nil {
		return err
	}
	port, err := freeport.Port("127.0.0.1")
	if err != nil {
		return err
	}
	config := filepath.Join(n.Dir, "kubelet.yaml")
	if err := os.WriteFile(config, []byte(kubeletConfig(port, n.env.CAFile(), n.Containerd.Address, n.cgroupRoot())), 0o644); err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(n.Dir, "kubelet.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin,
		"--config="+config,
		"--kubeconfig="+kubeconfig,
		"--root-dir="+n.KubeletDir,
		"--cert-dir="+filepath.Join(kdir, "pki"),
		"--hostname-override="+n.Name,
		"--v=2",
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Killed with its starter's thread, so that a killed test leaves no
	// kubelet behind.
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("kubenode: starting the kubelet: %w", err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	n.kubelet, n.exited = cmd, exited
	if err := n.waitReady(ctx, exited); err != nil {
		return fmt.Errorf("kubenode: %w\n%s", err, n.LogTail())
	}
	return nil
}

// cgroupRoot is the cgroup under which the kubelet puts its pods: one per
// node, since a kubelet removes pod cgroups it does not know of.
func (n *Node) cgroupRoot() string { return "/kubenode-" + n.bridge }

// kubeletConfig is the kubelet's configuration: serving on loopback,
// containerd's CRI, the cgroupfs driver under cgroupRoot, and eviction
// thresholds low enough for a shared test machine's disk. cgroup v1 is
// allowed (failCgroupV1), as some test machines have only it.
func kubeletConfig(port int, caFile, containerdSock, cgroupRoot string) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: %q
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupRoot: %s
failCgroupV1: false
failSwapOn: false
serializeImagePulls: false
registerNode: true
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
evictionHard:
  memory.available: 100Mi
  nodefs.available: "1%%"
  nodefs.inodesFree: "1%%"
  imagefs.available: "1%%"
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
resolvConf: /etc/resolv.conf
`, port, caFile, containerdSock, cgroupRoot)
}

// waitReady waits until the node reports Ready, or the kubelet exits.
func (n *Node) waitReady(ctx context.Context, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var last string
	for {
		node, err := n.env.Clientset().CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err == nil {
			for _, c := range node.Status.Conditions {
				if c.Type == corev1.NodeReady {
					if c.Status == corev1.ConditionTrue {
						return nil
					}
					last = c.Reason + ": " + c.Message
				}
			}
		} else {
			last = err.Error()
		}
		select {
		case <-exited:
			return errors.New("the kubelet exited")
		case <-ctx.Done():
			return fmt.Errorf("node %s not Ready: %w (last: %s)", n.Name, ctx.Err(), last)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// StopKubelet stops the kubelet (SIGTERM, then SIGKILL after ten
// seconds). Its pods keep running, as on a node whose kubelet restarts.
func (n *Node) StopKubelet() {
	n.mu.Lock()
	cmd, exited := n.kubelet, n.exited
	n.kubelet = nil
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(os.Interrupt)
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
	}
}

// Close stops the kubelet, removes every pod sandbox (killing their
// containers and releasing their networks), stops containerd, unmounts the
// pods' volumes and removes the bridge.
func (n *Node) Close() error {
	n.StopKubelet()
	var errs []error
	if n.Containerd != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		errs = append(errs, services.RemovePodSandboxesCRI(ctx, n.Containerd.Address))
		cancel()
		errs = append(errs, n.Containerd.Close())
	}
	errs = append(errs, services.UnmountUnder(n.Dir), removeCgroups(n.cgroupRoot()))
	if _, err := net.InterfaceByName(n.bridge); err == nil {
		if out, err := exec.Command("ip", "link", "del", n.bridge).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("removing bridge %s: %w: %s", n.bridge, err, out))
		}
	}
	return errors.Join(errs...)
}

// makeCgroups creates the cgroup root in every cgroup v1 hierarchy (the
// kubelet requires it to exist), with cgroup v1's cpuset copied from the
// parent, which a new cpuset cgroup otherwise lacks; or in the one
// hierarchy of cgroup v2.
func makeCgroups(root string) error {
	hierarchies, _ := filepath.Glob("/sys/fs/cgroup/*/cgroup.procs")
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		hierarchies = []string{"/sys/fs/cgroup/cgroup.procs"}
	}
	for _, procs := range hierarchies {
		parent := filepath.Dir(procs)
		dir := parent + root
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("kubenode: creating cgroup %s: %w", dir, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if v, err := os.ReadFile(filepath.Join(parent, f)); err == nil {
				if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
					return fmt.Errorf("kubenode: %s of %s: %w", f, dir, err)
				}
			}
		}
	}
	return nil
}

// removeCgroups removes the cgroup tree root, emptied of processes, from
// every hierarchy (cgroup v1's controllers, or the one of v2), deepest
// first.
func removeCgroups(root string) error {
	trees, _ := filepath.Glob("/sys/fs/cgroup/*" + root)
	trees = append(trees, "/sys/fs/cgroup"+root)
	var errs []error
	for _, tree := range trees {
		var dirs []string
		_ = filepath.WalkDir(tree, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := os.Remove(dirs[i]); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("removing cgroup %s: %w", dirs[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// LogTail returns the end of the kubelet's log, for failure messages.
func (n *Node) LogTail() string {
	b, err := os.ReadFile(filepath.Join(n.Dir, "kubelet.log"))
	if err != nil {
		return ""
	}
	if len(b) > 8192 {
		b = b[len(b)-8192:]
	}
	return string(b)
}

func fnv32(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}
