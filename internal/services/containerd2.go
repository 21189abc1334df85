package services

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
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
	return toolCacheDir("WEIGHTD_CONTAINERD_CACHE", "containerd-"+strings.TrimPrefix(version, "v"))
}

// ErrContainerdNotBuilt is returned (wrapped) by CachedContainerd when the
// version has not been built yet.
var ErrContainerdNotBuilt = errors.New("containerd not built")

// containerdInstall is the build of containerd, ctr and the runc shim
// (which runs pods' containers; Debian's 1.6 shim speaks an older task
// API) of version into ContainerdCacheDir(version).
func containerdInstall(version string) (goInstall, error) {
	dir, err := ContainerdCacheDir(version)
	if err != nil {
		return goInstall{}, err
	}
	const mod = "github.com/containerd/containerd/v2/cmd/"
	return goInstall{
		What:    "containerd " + version,
		Dir:     dir,
		Pkgs:    []string{mod + "containerd@" + version, mod + "ctr@" + version, mod + "containerd-shim-runc-v2@" + version},
		LDFlags: "-s -w -X github.com/containerd/containerd/v2/version.Version=" + strings.TrimPrefix(version, "v"),
		Bins:    []string{"containerd", "ctr", "containerd-shim-runc-v2"},
	}, nil
}

// CachedContainerd returns containerd and ctr of version from
// ContainerdCacheDir(version) without building them: an error wrapping
// ErrContainerdNotBuilt, with the binaries' paths still set, when they are
// not there.
func CachedContainerd(version string) (ContainerdBinaries, error) {
	g, err := containerdInstall(version)
	if err != nil {
		return ContainerdBinaries{}, err
	}
	bins := ContainerdBinaries{Containerd: filepath.Join(g.Dir, "containerd"), Ctr: filepath.Join(g.Dir, "ctr"), Version: version}
	if !g.built() {
		return bins, fmt.Errorf("%w: %s has no containerd and ctr %s (BuildContainerd builds them, as `go run ./bench/mirrorswarm` does)", ErrContainerdNotBuilt, g.Dir, version)
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
	g, err := containerdInstall(version)
	if err != nil {
		return ContainerdBinaries{}, err
	}
	if err := g.run(ctx); err != nil {
		return ContainerdBinaries{}, err
	}
	return bins, nil
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
`, c.Root, filepath.Join(c.Dir, "state"), c.Address, c.Address+".ttrpc", filepath.Join(c.Dir, "opt")) +
		c.registryConfig(`plugins."io.containerd.cri.v1.images".registry`)
}
