package services

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/weightd/weightd/internal/testbed"
)

// ContainerdBinary and CtrBinary are Debian's containerd 1.6 and its CLI.
const (
	ContainerdBinary = "/usr/bin/containerd"
	CtrBinary        = "/usr/bin/ctr"
)

// ContainerdConfig configures StartContainerd.
type ContainerdConfig struct {
	// Dir holds the daemon's root, state, sockets, config, log and HostsDir.
	// Required.
	Dir string
	// Binaries are the daemon and ctr to run: zero for Debian's 1.6
	// (ContainerdBinary, CtrBinary), or a containerd 2.x from
	// BuildContainerd, which gets a version 3 config.
	Binaries ContainerdBinaries
	// Host, when set, runs the daemon and ctr inside that testbed host's
	// network namespace, so that its pulls cross the host's link; the
	// sockets, in Dir, stay reachable from everywhere.
	Host *testbed.Host
	// ExtraConfig is TOML appended to the generated config (containerd
	// 2.x only): more plugin tables, such as the CRI runtime's for a node
	// that runs pods.
	ExtraConfig string
	// ConfigPath, when set, is the CRI registry's config_path in place of
	// HostsDir: another directory, or a list separated by ':'.
	ConfigPath string
	// NoConfigPath leaves the CRI registry's config_path out of the config,
	// as on a node whose containerd was never told where hosts.toml files
	// are: 1.6 then reads none, 2.x its default
	// (/etc/containerd/certs.d:/etc/docker/certs.d). HostsDir is made all
	// the same.
	NoConfigPath bool
}

// Containerd is a containerd daemon with all of its state in one directory,
// configured as a Kubernetes node's: the CRI plugin on, the overlayfs
// snapshotter, unpacked layers kept, registry hosts read from HostsDir.
// Its methods are safe for concurrent use.
type Containerd struct {
	// Address is the path of the daemon's gRPC socket.
	Address string
	// Root is the daemon's root directory (content store, snapshots,
	// metadata).
	Root string
	// HostsDir is the CRI plugin's registry config_path: a certs.d-style
	// directory of <host>/hosts.toml files, read on each pull. Under
	// ContainerdConfig.ConfigPath or NoConfigPath it is made all the same,
	// but containerd is not told of it.
	HostsDir string
	// Namespace is the CRI plugin's namespace, "k8s.io".
	Namespace string
	// Dir is ContainerdConfig.Dir.
	Dir string

	bins    ContainerdBinaries
	host    *testbed.Host
	extra   string
	path    string // the registry config_path written; "" for none
	sockDir string // a short directory for the sockets when Dir is too long; removed on Close

	mu     sync.Mutex
	proc   *process
	closed bool
}

// maxSocketPath is the longest socket path a sockaddr_un holds, with room for
// the ".ttrpc" suffix.
const maxSocketPath = 100 - len(".ttrpc")

// StartContainerd writes a config under cfg.Dir, starts containerd with it
// and waits until its socket answers. Close stops it. It needs root.
func StartContainerd(ctx context.Context, cfg ContainerdConfig) (*Containerd, error) {
	if cfg.Dir == "" {
		return nil, errors.New("containerd: no directory")
	}
	if err := cfg.Binaries.available(); err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, err
	}
	c := &Containerd{
		Root:      filepath.Join(dir, "root"),
		HostsDir:  filepath.Join(dir, "certs.d"),
		Namespace: "k8s.io",
		Dir:       dir,
		bins:      cfg.Binaries,
		host:      cfg.Host,
		extra:     cfg.ExtraConfig,
	}
	switch {
	case cfg.NoConfigPath && cfg.ConfigPath != "":
		return nil, errors.New("containerd: ConfigPath and NoConfigPath both set")
	case cfg.NoConfigPath:
	case cfg.ConfigPath != "":
		c.path = cfg.ConfigPath
	default:
		c.path = c.HostsDir
	}
	if cfg.ExtraConfig != "" && cfg.Binaries.Containerd == "" {
		return nil, errors.New("containerd: ExtraConfig is for containerd 2.x")
	}
	for _, d := range []string{dir, c.Root, c.HostsDir, filepath.Join(dir, "state"), filepath.Join(dir, "opt")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	c.Address = filepath.Join(dir, "containerd.sock")
	if len(c.Address) > maxSocketPath {
		if c.sockDir, err = os.MkdirTemp("", "ctrd"); err != nil {
			return nil, err
		}
		c.Address = filepath.Join(c.sockDir, "containerd.sock")
	}
	if err := os.WriteFile(c.configPath(), []byte(c.config()), 0o644); err != nil {
		return nil, errors.Join(err, c.cleanup())
	}
	if err := c.Start(ctx); err != nil {
		return nil, errors.Join(err, c.cleanup())
	}
	return c, nil
}

func (c *Containerd) configPath() string { return filepath.Join(c.Dir, "config.toml") }

func (c *Containerd) config() string {
	if c.bins.Containerd != "" {
		return c.configV3() + c.extra
	}
	return fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = %q

[ttrpc]
  address = %q

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = %q
  [plugins."io.containerd.grpc.v1.cri"]
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      discard_unpacked_layers = false
`, c.Root, filepath.Join(c.Dir, "state"), c.Address, c.Address+".ttrpc", filepath.Join(c.Dir, "opt")) +
		c.registryConfig(`plugins."io.containerd.grpc.v1.cri".registry`)
}

// registryConfig is the CRI registry table named table with its
// config_path, or nothing under NoConfigPath.
func (c *Containerd) registryConfig(table string) string {
	if c.path == "" {
		return ""
	}
	return fmt.Sprintf("    [%s]\n      config_path = %q\n", table, c.path)
}

// Start starts the daemon again after Stop, with the same directories. It
// does nothing if the daemon is running.
func (c *Containerd) Start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errors.New("containerd closed")
	}
	if c.proc != nil && !c.proc.exited() {
		return nil
	}
	_ = os.Remove(c.Address) // a stale socket of a killed daemon
	cmd := c.command(context.Background(), c.bins.daemon(), "--config", c.configPath())
	if c.bins.Containerd != "" {
		// The shim built beside a 2.x daemon, not Debian's 1.6 one in
		// /usr/bin, which it cannot drive.
		cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(c.bins.Containerd)+":"+os.Getenv("PATH"))
	}
	p, err := startCommand("containerd", cmd, filepath.Join(c.Dir, "containerd.log"))
	if err != nil {
		return err
	}
	err = p.waitFor(ctx, 30*time.Second, "containerd's socket", func() error {
		conn, err := net.DialTimeout("unix", c.Address, time.Second)
		if err != nil {
			return err
		}
		return conn.Close()
	})
	if err != nil {
		p.stop(5 * time.Second)
		return fmt.Errorf("starting containerd: %w", err)
	}
	c.proc = p
	return nil
}

// Stop sends the daemon SIGTERM and waits for it to exit (killing it after
// 10 s). Its shims, if any, keep running, as on a node; Close kills them.
func (c *Containerd) Stop() {
	c.mu.Lock()
	p := c.proc
	c.proc = nil
	c.mu.Unlock()
	if p != nil {
		p.stop(10 * time.Second)
	}
}

// Close stops the daemon, kills any shim it started and unmounts whatever it
// left mounted under Dir, so Dir can be removed.
func (c *Containerd) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	c.Stop()
	return c.cleanup()
}

func (c *Containerd) cleanup() error {
	killUnder(c.Address)
	err := UnmountUnder(c.Dir)
	if c.sockDir != "" {
		_ = os.RemoveAll(c.sockDir)
	}
	return err
}

// command returns a command that runs bin with args, in the daemon's
// testbed host if it has one.
func (c *Containerd) command(ctx context.Context, bin string, args ...string) *exec.Cmd {
	if c.host != nil {
		return c.host.Command(ctx, bin, args...)
	}
	return exec.CommandContext(ctx, bin, args...)
}

// CtrCommand returns a command that runs ctr against the daemon in its
// namespace (and in its testbed host, where ctr itself pulls for commands
// such as content fetch), for a caller that handles its output itself.
func (c *Containerd) CtrCommand(ctx context.Context, args ...string) *exec.Cmd {
	return c.command(ctx, c.bins.ctr(), append([]string{"--address", c.Address, "--namespace", c.Namespace}, args...)...)
}

// Ctr runs ctr against the daemon in its namespace and returns its combined
// output; a failure's error includes that output.
func (c *Containerd) Ctr(ctx context.Context, args ...string) ([]byte, error) {
	cmd := c.CtrCommand(ctx, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("ctr %v: %w: %s", args, err, bytes.TrimSpace(out.Bytes()))
	}
	return out.Bytes(), nil
}

// RemoveImages deletes every image record in the daemon's namespace (the
// CRI plugin adds its own, by repository digest and by image ID, that hold
// the content too) and, through containerd's garbage collector, their
// content and snapshots, so that the next pull starts empty. It fails if
// content is left.
func (c *Containerd) RemoveImages(ctx context.Context) error {
	// Output alone: ctr 2.x warns on stderr (cgroup v1).
	list := func(kind string) ([]string, error) {
		out, err := c.CtrCommand(ctx, kind, "ls", "-q").Output()
		if err != nil {
			return nil, fmt.Errorf("ctr %s ls: %w", kind, err)
		}
		return strings.Fields(string(out)), nil
	}
	names, err := list("images")
	if err != nil {
		return err
	}
	if len(names) > 0 {
		if _, err := c.Ctr(ctx, append([]string{"images", "rm", "--sync"}, names...)...); err != nil {
			return err
		}
	}
	left, err := list("content")
	if err != nil {
		return err
	}
	if len(left) > 0 {
		return fmt.Errorf("containerd still holds content after removing the images: %v", left)
	}
	return nil
}

// LogTail returns the end of the daemon's log, for failure messages.
func (c *Containerd) LogTail() string { return fileTail(filepath.Join(c.Dir, "containerd.log"), 8192) }
