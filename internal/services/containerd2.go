package services

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
)

// Containerd2Version is the containerd 2.x release the benchmarks run,
// built by BuildContainerd (Debian ships only 1.6).
const Containerd2Version = "v2.4.2"

// ContainerdBinaries are a containerd daemon and its ctr. The zero value is
// Debian's containerd 1.6 (ContainerdBinary, CtrBinary).
type ContainerdBinaries struct {
	Containerd, Ctr string
	// Version is the release they were built from ("v2.4.2"); empty for
	// Debian's.
	Version string
}

func (b ContainerdBinaries) daemon() string {
	if b.Containerd == "" {
		return ContainerdBinary
	}
	return b.Containerd
}

func (b ContainerdBinaries) ctr() string {
	if b.Ctr == "" {
		return CtrBinary
	}
	return b.Ctr
}

// available says why the binaries cannot run here, or nil.
func (b ContainerdBinaries) available() error {
	if b.Containerd == "" {
		return ContainerdAvailable()
	}
	var errs []error
	for _, p := range []string{b.Containerd, b.Ctr} {
		if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
			errs = append(errs, fmt.Errorf("%q is not an executable (BuildContainerd builds one)", p))
		}
	}
	if os.Geteuid() != 0 {
		errs = append(errs, errors.New("containerd needs root"))
	}
	return errors.Join(errs...)
}

var containerd2Release = regexp.MustCompile(`^v2\.[0-9]+\.[0-9]+$`)

// ContainerdCacheDir returns the directory BuildContainerd builds version
// into and reuses: $WEIGHTD_CONTAINERD_CACHE/containerd-<version> when that
// variable is set, else $HOME/.cache/weightd/containerd-<version> (keyed by
// version, so that a new release builds beside the old one).
func ContainerdCacheDir(version string) (string, error) {
	base := os.Getenv("WEIGHTD_CONTAINERD_CACHE")
	if base == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("finding the containerd build cache: %w (set WEIGHTD_CONTAINERD_CACHE)", err)
		}
		base = filepath.Join(home, ".cache", "weightd")
	}
	return filepath.Join(base, "containerd-"+strings.TrimPrefix(version, "v")), nil
}

// ErrContainerdNotBuilt is returned (wrapped) by CachedContainerd when the
// version has not been built yet.
var ErrContainerdNotBuilt = errors.New("containerd not built")

// CachedContainerd returns containerd and ctr of version from
// ContainerdCacheDir(version) without building them: an error wrapping
// ErrContainerdNotBuilt, with the binaries' paths still set, when they are
// not there.
func CachedContainerd(version string) (ContainerdBinaries, error) {
	dir, err := ContainerdCacheDir(version)
	if err != nil {
		return ContainerdBinaries{}, err
	}
	bins := ContainerdBinaries{Containerd: filepath.Join(dir, "containerd"), Ctr: filepath.Join(dir, "ctr"), Version: version}
	if !bins.built() {
		return bins, fmt.Errorf("%w: %s has no containerd and ctr %s (BuildContainerd builds them, as `go run ./bench/mirrorswarm` does)", ErrContainerdNotBuilt, dir, version)
	}
	return bins, nil
}

// BuildContainerd returns containerd and ctr of version (a 2.x release,
// "v2.4.2"), building them from the Go module proxy into
// ContainerdCacheDir(version) unless they are there already: about 3
// minutes on 2 cores with a cold Go build cache, nothing once built. It
// runs `go install <pkg>@<version>`, a build of containerd's own module,
// so its dependencies stay out of weightd's go.mod. The binaries are
// installed into a temporary directory beside the cache and renamed into
// place, so an interrupted build never leaves a half-written binary under
// its real name; a lock file makes concurrent callers (test binaries)
// build once. The go command's output is returned in the error of a
// failed build.
func BuildContainerd(ctx context.Context, version string) (ContainerdBinaries, error) {
	if !containerd2Release.MatchString(version) {
		return ContainerdBinaries{}, fmt.Errorf("building containerd %q: want a 2.x release, v2.MINOR.PATCH", version)
	}
	bins, err := CachedContainerd(version)
	if err == nil || !errors.Is(err, ErrContainerdNotBuilt) {
		return bins, err
	}
	dir := filepath.Dir(bins.Containerd)
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return ContainerdBinaries{}, err
	}
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return ContainerdBinaries{}, err
	}
	defer lock.Close() // releases the flock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return ContainerdBinaries{}, fmt.Errorf("locking %s: %w", lock.Name(), err)
	}
	if bins.built() { // another process built them while this one waited
		return bins, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return ContainerdBinaries{}, err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".containerd-build-")
	if err != nil {
		return ContainerdBinaries{}, err
	}
	defer os.RemoveAll(tmp)
	const mod = "github.com/containerd/containerd/v2/cmd/"
	cmd := exec.CommandContext(ctx, "go", "install", "-ldflags", "-s -w -X github.com/containerd/containerd/v2/version.Version="+strings.TrimPrefix(version, "v"),
		mod+"containerd@"+version, mod+"ctr@"+version)
	// Outside any module or workspace, with the caller's flags left out:
	// pkg@version builds containerd's module as its go.mod says.
	cmd.Dir = tmp
	cmd.Env = append(os.Environ(), "GOBIN="+tmp, "GOWORK=off", "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		return ContainerdBinaries{}, fmt.Errorf("building containerd %s (go install): %w\n%s", version, err, out)
	}
	for _, name := range []string{"containerd", "ctr"} {
		if err := os.Rename(filepath.Join(tmp, name), filepath.Join(dir, name)); err != nil {
			return ContainerdBinaries{}, fmt.Errorf("installing containerd %s: %w", version, err)
		}
	}
	return bins, nil
}

// built reports whether both binaries are in place.
func (b ContainerdBinaries) built() bool {
	for _, p := range []string{b.Containerd, b.Ctr} {
		if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// configV3 is the config of a containerd 2.x daemon: the same node as
// config's, in the layout of version 3 (the CRI image settings under
// io.containerd.cri.v1.images). NRI is off: every 2.x daemon of the machine
// would bind /var/run/nri/nri.sock otherwise.
func (c *Containerd) configV3() string {
	return fmt.Sprintf(`version = 3
root = %q
state = %q
disabled_plugins = [
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.erofs",
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
  [plugins."io.containerd.nri.v1.nri"]
    disable = true
  [plugins."io.containerd.grpc.v1.cri"]
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
  [plugins."io.containerd.cri.v1.images"]
    snapshotter = "overlayfs"
    discard_unpacked_layers = false
    [plugins."io.containerd.cri.v1.images".registry]
      config_path = %q
`, c.Root, filepath.Join(c.Dir, "state"), c.Address, c.Address+".ttrpc", filepath.Join(c.Dir, "opt"), c.HostsDir)
}
