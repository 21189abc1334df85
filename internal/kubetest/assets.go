package kubetest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// The versions of the binaries that Start runs. They match the k8s.io
// modules in go.mod (v0.37.2) and the etcd that Kubernetes 1.37 is tested
// with.
const (
	KubernetesVersion = "v1.37.2"
	EtcdVersion       = "v3.7.3"
)

// The names of the binaries in an assets directory.
const (
	apiserverBin = "kube-apiserver"
	etcdBin      = "etcd"
)

// The other Kubernetes programs that BuildAssets builds beside the API
// server, for the tests that run a whole node (test/e2e) or a real
// scheduler (pkg/extender).
const (
	SchedulerBin         = "kube-scheduler"
	ControllerManagerBin = "kube-controller-manager"
	KubeletBin           = "kubelet"
)

// ErrNoAssets means that no directory holds both kube-apiserver and etcd.
var ErrNoAssets = errors.New("kubetest: kube-apiserver and etcd not built")

// AssetsDir returns the directory where the binaries are built and looked
// for: $WEIGHTD_KUBE_ASSETS when set, else $HOME/.cache/weightd/kube-1.37.2
// (keyed by version, so that a new version builds beside the old one).
func AssetsDir() (string, error) {
	if d := os.Getenv("WEIGHTD_KUBE_ASSETS"); d != "" {
		return d, nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("finding the kube assets directory: %w (set WEIGHTD_KUBE_ASSETS)", err)
	}
	return filepath.Join(home, ".cache", "weightd", "kube-"+strings.TrimPrefix(KubernetesVersion, "v")), nil
}

// FindAssets returns a directory holding executable kube-apiserver and etcd
// binaries: $KUBEBUILDER_ASSETS when it holds both (the convention of
// controller-runtime's envtest), else AssetsDir. It returns an error
// wrapping ErrNoAssets, saying how to build them, when neither does.
func FindAssets() (string, error) {
	if d := os.Getenv("KUBEBUILDER_ASSETS"); d != "" && hasAssets(d) {
		return d, nil
	}
	d, err := AssetsDir()
	if err != nil {
		return "", err
	}
	if !hasAssets(d) {
		return "", fmt.Errorf("%w in %s: run `make kube-assets` (go run ./internal/kubetest/cmd/kube-assets; about 10 minutes the first time)", ErrNoAssets, d)
	}
	return d, nil
}

func hasAssets(dir string) bool {
	for _, name := range []string{apiserverBin, etcdBin} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			return false
		}
	}
	return true
}

// BuildAssets builds kube-apiserver, kube-scheduler, kube-controller-manager
// and kubelet KubernetesVersion and etcd EtcdVersion
// from the Go module proxy into dir, skipping a binary that is already
// there. Each is built to a temporary name in dir and renamed into place,
// so an interrupted build never leaves a half-written binary under its
// real name. The go command's output goes to log. A cold build takes about
// ten minutes on two cores (kube-apiserver is most of it); with a warm Go
// build cache, seconds.
func BuildAssets(ctx context.Context, dir string, log io.Writer) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating the kube assets directory: %w", err)
	}
	if _, err := os.Stat(filepath.Join(dir, etcdBin)); err != nil {
		if err := buildEtcd(ctx, dir, log); err != nil {
			return err
		}
	}
	for _, bin := range []string{apiserverBin, SchedulerBin, ControllerManagerBin, KubeletBin} {
		if _, err := os.Stat(filepath.Join(dir, bin)); err != nil {
			if err := buildKubeCommand(ctx, dir, bin, log); err != nil {
				return err
			}
		}
	}
	return nil
}

// Program returns the path of a program built beside the API server's
// assets (SchedulerBin, ControllerManagerBin, KubeletBin).
func Program(name string) (string, error) {
	dir, err := FindAssets()
	if err != nil {
		return "", err
	}
	p := filepath.Join(dir, name)
	if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
		return "", fmt.Errorf("%w: no %s in %s: run `make kube-assets`", ErrNoAssets, name, dir)
	}
	return p, nil
}

// buildKubeCommand builds k8s.io/kubernetes/cmd/<name> (kube-apiserver,
// kube-scheduler, …) in a wrapper module. k8s.io/kubernetes cannot be required as it stands: its go.mod
// replaces every staging module (k8s.io/api, k8s.io/client-go, …) with a
// directory of its own tree, and requires them at v0.0.0. The wrapper
// replaces each with its published release instead (v0.37.2 for v1.37.2),
// except the sample modules, which the proxy does not serve and the
// apiserver does not need.
func buildKubeCommand(ctx context.Context, dir, name string, log io.Writer) error {
	work, err := os.MkdirTemp("", "weightd-"+name+"-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	staging, err := stagingModules(ctx, work, log)
	if err != nil {
		return err
	}
	stagingVersion := "v0." + strings.TrimPrefix(KubernetesVersion, "v1.")
	var mod bytes.Buffer
	fmt.Fprintf(&mod, "module weightd.local/%s\n\ngo 1.26\n\nrequire k8s.io/kubernetes %s\n\n", name, KubernetesVersion)
	for _, m := range staging {
		fmt.Fprintf(&mod, "replace %s => %s %s\n", m, m, stagingVersion)
	}
	ldflags := fmt.Sprintf("-s -w -X k8s.io/component-base/version.gitVersion=%s -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=%s",
		KubernetesVersion, strings.SplitN(strings.TrimPrefix(KubernetesVersion, "v1."), ".", 2)[0])
	return buildWrapped(ctx, work, mod.Bytes(), "k8s.io/kubernetes/cmd/"+name, ldflags, filepath.Join(dir, name), log)
}

// buildEtcd builds go.etcd.io/etcd/server/v3 (the etcd program) in a
// wrapper module: `go install …@version` refuses it for its replace
// directives.
func buildEtcd(ctx context.Context, dir string, log io.Writer) error {
	work, err := os.MkdirTemp("", "weightd-etcd-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	mod := fmt.Sprintf("module weightd.local/etcd\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 %s\n", EtcdVersion)
	ldflags := "-s -w"
	return buildWrapped(ctx, work, []byte(mod), "go.etcd.io/etcd/server/v3", ldflags, filepath.Join(dir, etcdBin), log)
}

// buildWrapped writes the wrapper module gomod into work with a file that
// imports pkg (so go mod tidy keeps what it needs), tidies it and builds
// pkg to out through a temporary name.
func buildWrapped(ctx context.Context, work string, gomod []byte, pkg, ldflags, out string, log io.Writer) error {
	if err := os.WriteFile(filepath.Join(work, "go.mod"), gomod, 0o644); err != nil {
		return err
	}
	tools := fmt.Sprintf("//go:build tools\n\npackage tools\n\nimport _ %q\n", pkg)
	if err := os.WriteFile(filepath.Join(work, "tools.go"), []byte(tools), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(log, "building %s into %s\n", pkg, out)
	if err := goCmd(ctx, work, log, "mod", "tidy"); err != nil {
		return fmt.Errorf("resolving %s: %w", pkg, err)
	}
	tmp := fmt.Sprintf("%s.tmp-%d", out, os.Getpid())
	defer os.Remove(tmp)
	if err := goCmd(ctx, work, log, "build", "-ldflags", ldflags, "-o", tmp, pkg); err != nil {
		return fmt.Errorf("building %s: %w", pkg, err)
	}
	if err := os.Rename(tmp, out); err != nil {
		return fmt.Errorf("installing %s: %w", out, err)
	}
	return nil
}

// stagingModules lists the modules that k8s.io/kubernetes replaces with
// directories of its staging tree, less the sample modules.
func stagingModules(ctx context.Context, work string, log io.Writer) ([]string, error) {
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", "k8s.io/kubernetes@"+KubernetesVersion)
	cmd.Dir = work
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
	cmd.Stdout = &out
	cmd.Stderr = log
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("downloading k8s.io/kubernetes %s: %w", KubernetesVersion, err)
	}
	var info struct{ GoMod, Error string }
	if err := json.Unmarshal(out.Bytes(), &info); err != nil {
		return nil, fmt.Errorf("reading go mod download's answer: %w", err)
	}
	if info.Error != "" {
		return nil, fmt.Errorf("downloading k8s.io/kubernetes %s: %s", KubernetesVersion, info.Error)
	}
	f, err := os.Open(info.GoMod)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var mods []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		// "k8s.io/api => ./staging/src/k8s.io/api", inside a replace block.
		if len(fields) != 3 || fields[1] != "=>" || !strings.HasPrefix(fields[2], "./staging/") {
			continue
		}
		if strings.HasPrefix(fields[0], "k8s.io/sample-") && fields[0] != "k8s.io/sample-apiserver" {
			continue
		}
		mods = append(mods, fields[0])
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(mods) == 0 {
		return nil, fmt.Errorf("k8s.io/kubernetes %s: no staging modules in %s", KubernetesVersion, info.GoMod)
	}
	return mods, nil
}

func goCmd(ctx context.Context, dir string, log io.Writer, args ...string) error {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	// The wrapper module names its own Go version; the caller's
	// GOFLAGS (say -mod=vendor) must not leak into it.
	cmd.Env = append(os.Environ(), "GOFLAGS=", "GOWORK=off")
	cmd.Stdout = log
	cmd.Stderr = log
	return cmd.Run()
}
