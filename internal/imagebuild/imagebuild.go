package imagebuild

import (
	"context"
	"errors"
	"fmt"
	"path"
	"path/filepath"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Where things are in the image.
const (
	// BinaryPath is where the image holds weightd.
	BinaryPath = "/usr/local/bin/weightd"
	// PathEnv is the image's PATH (Docker's default).
	PathEnv = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	// DefaultSource is the org.opencontainers.image.source label's default.
	DefaultSource = "https://github.com/weightd/weightd"
	// DefaultCACerts is the CA bundle the image carries by default.
	DefaultCACerts = "/etc/ssl/certs/ca-certificates.crt"
)

// The OCI annotation (and label) keys the image sets.
const (
	LabelTitle    = "org.opencontainers.image.title"
	LabelVersion  = "org.opencontainers.image.version"
	LabelRevision = "org.opencontainers.image.revision"
	LabelSource   = "org.opencontainers.image.source"
	LabelCreated  = "org.opencontainers.image.created"
)

// Binary is a weightd executable built for one architecture with cgo, and
// where this machine keeps the glibc that goes with it.
type Binary struct {
	// Path is the executable. Required.
	Path string
	// Arch is its GOARCH, amd64 or arm64. Required; it must match the
	// ELF header.
	Arch string
	// LibDirs are searched, in order, for the shared libraries it needs;
	// nil means DefaultLibDirs(Arch).
	LibDirs []string
}

// Options configures Build.
type Options struct {
	// Binaries are the executables, one per architecture. At least one.
	Binaries []Binary
	// Version and Revision are the version and commit stamped into the
	// binaries; they label the image.
	Version, Revision string
	// Source is the repository's address; empty means DefaultSource.
	Source string
	// Created dates the image and every file in it (to the second); the
	// zero time means the Unix epoch.
	Created time.Time
	// CACerts is the PEM bundle put at /etc/ssl/certs/ca-certificates.crt;
	// empty means DefaultCACerts.
	CACerts string
}

// Build assembles one image per binary and an OCI image index over them
// (in the order of opts.Binaries). It compresses every layer to learn its
// digest and keeps the compressed bytes in memory (about 40 MB per
// architecture), from which WriteTarball and Push read; the uncompressed
// layers are read from the binaries and libraries again, so those files
// must not change while the index is in use.
func Build(ctx context.Context, opts Options) (v1.ImageIndex, error) {
	if len(opts.Binaries) == 0 {
		return nil, errors.New("imagebuild: no binaries")
	}
	if opts.Source == "" {
		opts.Source = DefaultSource
	}
	if opts.CACerts == "" {
		opts.CACerts = DefaultCACerts
	}
	if opts.Created.IsZero() {
		opts.Created = time.Unix(0, 0)
	}
	opts.Created = opts.Created.UTC().Truncate(time.Second)

	seen := map[string]bool{}
	for _, b := range opts.Binaries {
		if seen[b.Arch] {
			return nil, fmt.Errorf("imagebuild: two binaries for %s", b.Arch)
		}
		seen[b.Arch] = true
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, b := range opts.Binaries {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		img, err := buildImage(b, opts)
		if err != nil {
			return nil, fmt.Errorf("imagebuild: linux/%s: %w", b.Arch, err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			return nil, err
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add:        img,
			Descriptor: v1.Descriptor{Platform: cf.Platform()},
		})
	}
	return mutate.Annotations(idx, annotations(opts)).(v1.ImageIndex), nil
}

func annotations(opts Options) map[string]string {
	return map[string]string{
		LabelTitle:    "weightd",
		LabelVersion:  opts.Version,
		LabelRevision: opts.Revision,
		LabelSource:   opts.Source,
		LabelCreated:  opts.Created.Format(time.RFC3339),
	}
}

// buildImage assembles the image of one binary: the base layer, then the
// binary's.
func buildImage(b Binary, opts Options) (v1.Image, error) {
	a, err := lookupArch(b.Arch)
	if err != nil {
		return nil, err
	}
	info, err := readELF(b.Path)
	if err != nil {
		return nil, err
	}
	if info.machine != a.machine {
		return nil, fmt.Errorf("%s is an ELF for %v, not %s", b.Path, info.machine, b.Arch)
	}
	dirs := b.LibDirs
	if dirs == nil {
		if dirs, err = DefaultLibDirs(b.Arch); err != nil {
			return nil, err
		}
	}
	libs, err := resolveLibs(info, dirs, a.machine)
	if err != nil {
		return nil, err
	}
	baseEntries, err := baseFiles(a, info.interp, libs, opts.CACerts)
	if err != nil {
		return nil, err
	}
	base, err := newLayer(baseEntries, opts.Created)
	if err != nil {
		return nil, err
	}
	bin, err := copyOf(strings.TrimPrefix(BinaryPath, "/"), 0o755, b.Path)
	if err != nil {
		return nil, err
	}
	app, err := newLayer([]entry{bin}, opts.Created)
	if err != nil {
		return nil, err
	}

	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	created := v1.Time{Time: opts.Created}
	img, err = mutate.Append(img,
		mutate.Addendum{Layer: base, MediaType: types.OCILayer, History: v1.History{
			Created:   created,
			CreatedBy: "imagebuild: glibc from " + strings.Join(dirs, ":") + ", CA certificates, /etc/passwd, /tmp",
			Comment:   "the base layer",
		}},
		mutate.Addendum{Layer: app, MediaType: types.OCILayer, History: v1.History{
			Created:   created,
			CreatedBy: "imagebuild: weightd " + opts.Version + " at " + BinaryPath,
		}},
	)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Variant = "linux", b.Arch, a.variant
	cf.Created = created
	cf.Config = v1.Config{
		Entrypoint: []string{"weightd"},
		Env:        []string{"PATH=" + PathEnv},
		WorkingDir: "/",
		Labels:     annotations(opts),
	}
	return mutate.ConfigFile(img, cf)
}

// baseFiles lists the base layer: glibc laid out as in Debian 12 (merged
// /usr: /lib is a link to usr/lib), the loader also at the binary's
// PT_INTERP path, the users, the CA bundle, /tmp and /root.
func baseFiles(a arch, interp string, libs []lib, caCerts string) ([]entry, error) {
	libDir := "usr/lib/" + a.tuple
	entries := []entry{
		symlink("lib", "usr/lib"),
		dir("root", 0o700),
		dir("tmp", 0o1777),
		file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n")),
		file("etc/group", 0o644, []byte("root:x:0:\nnogroup:x:65534:\n")),
		// Go reads it to choose between its own resolver and libc's.
		file("etc/nsswitch.conf", 0o644, []byte("passwd: files\ngroup: files\nhosts: files dns\n")),
	}
	ca, err := copyOf("etc/ssl/certs/ca-certificates.crt", 0o644, caCerts)
	if err != nil {
		return nil, fmt.Errorf("the CA certificates (apt-get install ca-certificates, or Options.CACerts): %w", err)
	}
	entries = append(entries, ca)
	for _, l := range libs {
		e, err := copyOf(libDir+"/"+l.name, 0o755, l.src)
		if err != nil {
			return nil, err
		}
		entries = append(entries, e)
	}

	// The loader's path in the ELF, e.g. /lib64/ld-linux-x86-64.so.2 or
	// /lib/ld-linux-aarch64.so.1: through lib or lib64, which link to
	// usr/lib and usr/lib64, to a link to the loader in libDir.
	interp = path.Clean(interp)
	top, _, _ := strings.Cut(strings.TrimPrefix(interp, "/"), "/")
	linkPath := strings.TrimPrefix(interp, "/")
	switch top {
	case "lib":
		linkPath = "usr/" + linkPath
	case "lib64":
		entries = append(entries, symlink("lib64", "usr/lib64"))
		linkPath = "usr/" + linkPath
	case "usr":
	default:
		return nil, fmt.Errorf("the loader %s is not under /lib, /lib64 or /usr", interp)
	}
	loader := libDir + "/" + path.Base(interp)
	if linkPath != loader {
		rel, err := filepath.Rel(path.Dir(linkPath), loader)
		if err != nil {
			return nil, err
		}
		entries = append(entries, symlink(linkPath, rel))
	}
	return entries, nil
}
