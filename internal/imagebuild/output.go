package imagebuild

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"time"

	distref "github.com/distribution/reference"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// annotationImageName is containerd's name for an image in an OCI layout's
// index.json (images.AnnotationImageName): `ctr images import` names the
// image after it.
const annotationImageName = "io.containerd.image.name"

// WriteTarball writes idx to path as a tar of an OCI image layout, named
// ref (which must have a tag) as containerd's own exporter names images:
// the full reference in io.containerd.image.name, the tag in
// org.opencontainers.image.ref.name. `ctr images import` and `docker load`
// (with the containerd image store) import it under that name; `skopeo copy
// oci-archive:` and `crane push` push it. The file is replaced atomically.
func WriteTarball(path, ref string, idx v1.ImageIndex) error {
	named, err := distref.ParseDockerRef(ref)
	if err != nil {
		return fmt.Errorf("parsing reference %q: %w", ref, err)
	}
	tagged, ok := named.(distref.Tagged)
	if !ok {
		return fmt.Errorf("reference %q has no tag", ref)
	}
	dir, err := os.MkdirTemp(filepath.Dir(path), ".imagebuild-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(filepath.Join(dir, "layout"), empty.Index)
	if err != nil {
		return err
	}
	if err := lp.AppendIndex(idx, layout.WithAnnotations(map[string]string{
		annotationImageName:                 named.String(),
		"org.opencontainers.image.ref.name": tagged.Tag(),
	})); err != nil {
		return fmt.Errorf("writing the OCI layout: %w", err)
	}
	tmp := filepath.Join(dir, "image.tar")
	if err := tarDir(tmp, string(lp)); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// tarDir writes the tree under root to the tar file dst, sorted, with
// fixed times and owners.
func tarDir(dst, root string) (err error) {
	var names []string
	if err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		if !d.IsDir() && !d.Type().IsRegular() {
			return fmt.Errorf("%s: not a regular file", p)
		}
		names = append(names, p)
		return nil
	}); err != nil {
		return err
	}
	slices.Sort(names)
	f, err := os.Create(dst)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	tw := tar.NewWriter(f)
	for _, p := range names {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: filepath.ToSlash(rel), Mode: 0o644, ModTime: time.Unix(0, 0), Typeflag: tar.TypeReg, Size: fi.Size()}
		if fi.IsDir() {
			hdr.Name += "/"
			hdr.Mode, hdr.Typeflag, hdr.Size = 0o755, tar.TypeDir, 0
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.IsDir() {
			continue
		}
		if err := copyFile(tw, p, fi.Size()); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return f.Sync()
}

// Push writes idx to the registry of ref with the credentials of the
// Docker config (~/.docker/config.json and its helpers). Loopback and
// private-network registries are spoken to over plain HTTP; insecure allows
// it for any registry.
func Push(ctx context.Context, ref string, idx v1.ImageIndex, insecure bool) error {
	var opts []name.Option
	if insecure {
		opts = append(opts, name.Insecure)
	}
	r, err := name.ParseReference(ref, opts...)
	if err != nil {
		return fmt.Errorf("parsing reference %q: %w", ref, err)
	}
	if _, ok := r.(name.Tag); !ok {
		return errors.New("pushing needs a tagged reference")
	}
	if err := remote.WriteIndex(r, idx, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return fmt.Errorf("pushing %s: %w", r, err)
	}
	return nil
}
