package imagebuild

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
)

// ErrNoCrossCompiler is returned by Compile for an architecture other than
// the host's when Debian's cross toolchain for it is not installed.
var ErrNoCrossCompiler = errors.New("no cross toolchain")

// CompileOptions configures Compile.
type CompileOptions struct {
	// ModuleDir is the weightd module's root. Required.
	ModuleDir string
	// Arch is the GOARCH to build for; empty means the host's.
	Arch string
	// Out is the executable to write. Required.
	Out string
	// Version and Commit are stamped in as `make build` stamps them
	// (-X main.version, -X main.commit).
	Version, Commit string
	// Go is the go command; empty means "go" from PATH.
	Go string
}

// CrossCompiler returns the C compiler that builds cgo code for goarch on
// this machine and the directory of that architecture's glibc: none and nil
// for the host's architecture, Debian's <tuple>-gcc and /usr/<tuple>/lib
// for the other, or ErrNoCrossCompiler naming the packages to install.
func CrossCompiler(goarch string) (cc string, libDirs []string, err error) {
	a, err := lookupArch(goarch)
	if err != nil {
		return "", nil, err
	}
	if goarch == runtime.GOARCH {
		return "", nil, nil
	}
	cc, err = exec.LookPath(a.tuple + "-gcc")
	if err == nil {
		libDirs, err = DefaultLibDirs(goarch)
	}
	if err == nil {
		_, err = os.Stat(filepath.Join(libDirs[0], "libc.so.6"))
	}
	if err != nil {
		return "", nil, fmt.Errorf("%w for %s (apt-get install %s): %v", ErrNoCrossCompiler, goarch, a.pkgs, err)
	}
	return cc, libDirs, nil
}

// Compile builds cmd/weightd as `make build` does (cgo, -trimpath, the
// version and commit stamped in) for opts.Arch, with the cross compiler of
// CrossCompiler for another architecture, and returns it as a Binary for
// Build.
func Compile(ctx context.Context, opts CompileOptions) (Binary, error) {
	if opts.ModuleDir == "" || opts.Out == "" {
		return Binary{}, errors.New("imagebuild: Compile needs ModuleDir and Out")
	}
	if opts.Arch == "" {
		opts.Arch = runtime.GOARCH
	}
	if opts.Go == "" {
		opts.Go = "go"
	}
	cc, libDirs, err := CrossCompiler(opts.Arch)
	if err != nil {
		return Binary{}, err
	}
	out, err := filepath.Abs(opts.Out)
	if err != nil {
		return Binary{}, err
	}
	if strings.ContainsAny(opts.Version+opts.Commit, " \t\n'\"") {
		return Binary{}, fmt.Errorf("imagebuild: version %q or commit %q has spaces or quotes", opts.Version, opts.Commit)
	}
	ldflags := fmt.Sprintf("-X main.version=%s -X main.commit=%s", opts.Version, opts.Commit)
	cmd := exec.CommandContext(ctx, opts.Go, "build", "-trimpath", "-ldflags", ldflags, "-o", out, "./cmd/weightd")
	cmd.Dir = opts.ModuleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=1", "GOOS=linux", "GOARCH="+opts.Arch)
	if cc != "" {
		cmd.Env = append(cmd.Env, "CC="+cc)
	}
	if os.Getenv("CGO_CFLAGS") == "" {
		// As the Makefile sets it: go-nvml calls functions NVML marks
		// deprecated.
		cmd.Env = append(cmd.Env, "CGO_CFLAGS=-O2 -g -Wno-deprecated-declarations")
	}
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Run(); err != nil {
		return Binary{}, fmt.Errorf("building weightd for linux/%s: %w\n%s", opts.Arch, err, stderr.Bytes())
	}
	return Binary{Path: out, Arch: opts.Arch, LibDirs: libDirs}, nil
}
