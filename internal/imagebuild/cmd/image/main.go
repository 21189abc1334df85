// Command image builds weightd's container image without a Docker daemon
// (package imagebuild) and writes it as an OCI layout tarball; with -push it
// also pushes it. `make image` runs it:
//
//	go run ./internal/imagebuild/cmd/image -version v1.2.3 -commit abc1234 \
//	    [-image ghcr.io/weightd/weightd:v1.2.3] [-o bin/weightd-image.tar] \
//	    [-arch amd64,arm64] [-push [-insecure]] [-go go]
//
// Without -arch it builds the host's architecture, and the other of amd64
// and arm64 too where Debian's cross toolchain is installed (it says what to
// install where not). Files and the image are dated SOURCE_DATE_EPOCH, else
// the time of the commit checked out, so that builds repeat. The last line
// it prints is the image's reference.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/weightd/weightd/internal/imagebuild"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		version  = flag.String("version", "dev", "the version stamped into the binary and labelled on the image")
		commit   = flag.String("commit", "dev", "the commit stamped into the binary and labelled on the image")
		ref      = flag.String("image", "", "the image's reference (default ghcr.io/weightd/weightd:<version>)")
		out      = flag.String("o", "bin/weightd-image.tar", "the OCI layout tarball to write")
		archList = flag.String("arch", "", "comma-separated architectures, each required (default: the host's, and the other of amd64 and arm64 where its cross toolchain is installed)")
		binDir   = flag.String("bindir", "bin/image", "where the binaries are built, one directory per platform")
		module   = flag.String("module", ".", "the weightd module's root")
		goCmd    = flag.String("go", "go", "the go command that builds the binaries")
		push     = flag.Bool("push", false, "push the image to the registry of -image too")
		insecure = flag.Bool("insecure", false, "allow plain HTTP to the registry (always allowed for loopback and private addresses)")
	)
	flag.Parse()
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	if *ref == "" {
		*ref = "ghcr.io/weightd/weightd:" + *version
	}
	if _, err := name.NewTag(*ref, name.StrictValidation); err != nil {
		return fmt.Errorf("-image %q: %w (a repository and a tag: set IMAGE=, or a VERSION that is a valid tag)", *ref, err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	created, err := sourceDate(ctx, *module)
	if err != nil {
		return err
	}
	archs, optional := []string{runtime.GOARCH}, true
	if *archList != "" {
		archs, optional = strings.Split(*archList, ","), false
	} else {
		for _, a := range []string{"amd64", "arm64"} {
			if a != runtime.GOARCH {
				archs = append(archs, a)
			}
		}
	}

	var bins []imagebuild.Binary
	for _, a := range archs {
		if _, _, err := imagebuild.CrossCompiler(a); optional && errors.Is(err, imagebuild.ErrNoCrossCompiler) {
			fmt.Fprintf(os.Stderr, "image: leaving linux/%s out: %v\n", a, err)
			continue
		}
		fmt.Fprintf(os.Stderr, "image: building weightd %s for linux/%s\n", *version, a)
		b, err := imagebuild.Compile(ctx, imagebuild.CompileOptions{
			ModuleDir: *module,
			Arch:      a,
			Out:       filepath.Join(*binDir, "linux_"+a, "weightd"),
			Version:   *version,
			Commit:    *commit,
			Go:        *goCmd,
		})
		if err != nil {
			return err
		}
		bins = append(bins, b)
	}

	idx, err := imagebuild.Build(ctx, imagebuild.Options{
		Binaries: bins,
		Version:  *version,
		Revision: *commit,
		Created:  created,
	})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(*out), 0o755); err != nil {
		return err
	}
	if err := imagebuild.WriteTarball(*out, *ref, idx); err != nil {
		return err
	}
	if err := describe(idx, *out); err != nil {
		return err
	}
	if *push {
		fmt.Fprintf(os.Stderr, "image: pushing %s\n", *ref)
		if err := imagebuild.Push(ctx, *ref, idx, *insecure); err != nil {
			return err
		}
	}
	fmt.Println(*ref)
	return nil
}

// sourceDate is SOURCE_DATE_EPOCH, else the commit time of HEAD in dir,
// else the Unix epoch.
func sourceDate(ctx context.Context, dir string) (time.Time, error) {
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q: %w", s, err)
		}
		return time.Unix(n, 0), nil
	}
	cmd := exec.CommandContext(ctx, "git", "log", "-1", "--format=%ct")
	cmd.Dir = dir
	if b, err := cmd.Output(); err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil {
			return time.Unix(n, 0), nil
		}
	}
	return time.Unix(0, 0), nil
}

// describe prints each platform's digest and size, and the tarball's.
func describe(idx v1.ImageIndex, out string) error {
	im, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	for _, d := range im.Manifests {
		img, err := idx.Image(d.Digest)
		if err != nil {
			return err
		}
		m, err := img.Manifest()
		if err != nil {
			return err
		}
		size := d.Size + m.Config.Size
		for _, l := range m.Layers {
			size += l.Size
		}
		fmt.Fprintf(os.Stderr, "image: %s %s, %.1f MB compressed\n", d.Platform, d.Digest, float64(size)/1e6)
	}
	digest, err := idx.Digest()
	if err != nil {
		return err
	}
	fi, err := os.Stat(out)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "image: index %s written to %s (%.1f MB); import it with: ctr -n k8s.io images import %s\n",
		digest, out, float64(fi.Size())/1e6, out)
	return nil
}
