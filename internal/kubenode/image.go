package kubenode

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// PauseImage is the sandbox image the node's CRI runs for each pod:
// built here from pauseSource and imported at Start, since no registry
// that serves registry.k8s.io/pause is reachable.
const PauseImage = "kubenode.test/pause:1"

// PauseSource holds a pod's namespaces open until it is told to stop:
// the sandbox's program, and any test container that only needs to run.
const PauseSource = `package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}
`

// importPause builds the pause program and imports its image.
func importPause(ctx context.Context, n *Node) error {
	bin, err := BuildStatic(ctx, filepath.Join(n.Dir, "pause-build"), "pause", PauseSource)
	if err != nil {
		return err
	}
	img, err := ProgramImage(bin, "/pause")
	if err != nil {
		return err
	}
	return n.ImportImage(ctx, PauseImage, img)
}

// BuildStatic compiles a one-file Go program, source, into a static
// binary named name under dir (created), for test images.
func BuildStatic(ctx context.Context, dir, name, source string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module kubenode.test/"+name+"\n\ngo 1.26\n"), 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(source), 0o644); err != nil {
		return "", err
	}
	out := filepath.Join(dir, name)
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("kubenode: building %s: %w: %s", name, err, b)
	}
	return out, nil
}

// ProgramImage is an image of the program bin alone, at path, as its
// entrypoint, with more layers on top (data for a pull to move).
func ProgramImage(bin, path string, more ...v1.Layer) (v1.Image, error) {
	data, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	layer, err := FilesLayer(map[string][]byte{path: data}, 0o755)
	if err != nil {
		return nil, err
	}
	img, err := mutate.AppendLayers(empty.Image, append([]v1.Layer{layer}, more...)...)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = "amd64", "linux"
	cf.Config.Entrypoint = []string{path}
	return mutate.ConfigFile(img, cf)
}

// FilesLayer is an uncompressed-then-gzipped layer holding files (path →
// content) with mode, and their parent directories.
func FilesLayer(files map[string][]byte, mode int64) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	for p, data := range files {
		for d := filepath.Dir(p); d != "/" && d != "." && !dirs[d]; d = filepath.Dir(d) {
			dirs[d] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d[1:] + "/", Mode: 0o755}); err != nil {
				return nil, err
			}
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: p[1:], Mode: mode, Size: int64(len(data))}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
}

// ImportImage imports img into the node's containerd under ref, in the
// CRI's namespace, as `ctr images import` does with a saved image: the
// kubelet then finds it without pulling.
func (n *Node) ImportImage(ctx context.Context, ref string, img v1.Image) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(n.Dir, "image-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	f.Close()
	if err := tarball.WriteToFile(f.Name(), tag, img); err != nil {
		return fmt.Errorf("kubenode: saving %s: %w", ref, err)
	}
	return n.ImportArchive(ctx, f.Name())
}

// ImportArchive imports a saved image (a docker-archive or OCI layout
// tarball, as `make image` writes) into the CRI's namespace.
func (n *Node) ImportArchive(ctx context.Context, path string) error {
	if _, err := n.Containerd.Ctr(ctx, "images", "import", path); err != nil {
		return fmt.Errorf("kubenode: importing %s: %w", path, err)
	}
	return nil
}

func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
