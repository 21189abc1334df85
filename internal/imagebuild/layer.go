package imagebuild

import (
	"archive/tar"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// entry is one file, directory or symbolic link of a layer.
type entry struct {
	name string // relative to the root, without a leading slash
	mode int64  // permission bits, with the sticky bit for /tmp
	typ  byte   // tar.TypeReg, tar.TypeDir or tar.TypeSymlink
	data []byte // a regular file's contents, when src is empty
	src  string // a regular file to copy from this machine
	size int64  // src's size, fixed when the entry is made
	link string // a symbolic link's target
}

func dir(name string, mode int64) entry { return entry{name: name, mode: mode, typ: tar.TypeDir} }

func symlink(name, target string) entry {
	return entry{name: name, mode: 0o777, typ: tar.TypeSymlink, link: target}
}

func file(name string, mode int64, data []byte) entry {
	return entry{name: name, mode: mode, typ: tar.TypeReg, data: data, size: int64(len(data))}
}

// copyOf is the file src of this machine at name: it must be a regular file
// (after symbolic links).
func copyOf(name string, mode int64, src string) (entry, error) {
	fi, err := os.Stat(src)
	if err != nil {
		return entry{}, err
	}
	if !fi.Mode().IsRegular() {
		return entry{}, fmt.Errorf("%s is not a regular file", src)
	}
	return entry{name: name, mode: mode, typ: tar.TypeReg, src: src, size: fi.Size()}, nil
}

// withParents returns entries sorted by name, with a directory (0755) added
// for every parent that the entries do not list themselves. It fails if a
// name appears twice or a parent is not a directory.
func withParents(entries []entry) ([]entry, error) {
	byName := map[string]entry{}
	for _, e := range entries {
		if e.name == "" || strings.HasPrefix(e.name, "/") || path.Clean(e.name) != e.name {
			return nil, fmt.Errorf("bad layer path %q", e.name)
		}
		if _, dup := byName[e.name]; dup {
			return nil, fmt.Errorf("%s twice in a layer", e.name)
		}
		byName[e.name] = e
	}
	for _, e := range entries {
		for p := path.Dir(e.name); p != "."; p = path.Dir(p) {
			parent, ok := byName[p]
			if !ok {
				byName[p] = dir(p, 0o755)
			} else if parent.typ != tar.TypeDir {
				return nil, fmt.Errorf("%s is under %s, which is not a directory", e.name, p)
			}
		}
	}
	out := make([]entry, 0, len(byName))
	for _, e := range byName {
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b entry) int { return strings.Compare(a.name, b.name) })
	return out, nil
}

// writeTar writes entries as a tar stream, every entry owned by root and
// dated mtime.
func writeTar(w io.Writer, entries []entry, mtime time.Time) error {
	tw := tar.NewWriter(w)
	for _, e := range entries {
		hdr := &tar.Header{
			Typeflag: e.typ,
			Name:     e.name,
			Linkname: e.link,
			Mode:     e.mode,
			ModTime:  mtime,
			Format:   tar.FormatPAX,
		}
		if e.typ == tar.TypeDir {
			hdr.Name += "/"
		}
		if e.typ == tar.TypeReg {
			hdr.Size = e.size
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if e.typ != tar.TypeReg {
			continue
		}
		if e.src == "" {
			if _, err := tw.Write(e.data); err != nil {
				return err
			}
			continue
		}
		if err := copyFile(tw, e.src, e.size); err != nil {
			return err
		}
	}
	return tw.Close()
}

func copyFile(w io.Writer, src string, size int64) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(w, io.LimitReader(f, size+1))
	if err != nil {
		return fmt.Errorf("copying %s: %w", src, err)
	}
	if n != size {
		return fmt.Errorf("copying %s: it changed size (%d bytes, then %d) during the build", src, size, n)
	}
	return nil
}

// newLayer returns a gzipped OCI layer of entries. The tar stream is made
// again from the entries (and their source files) each time the layer is
// read uncompressed; the compressed bytes are kept in memory once made.
func newLayer(entries []entry, mtime time.Time) (v1.Layer, error) {
	entries, err := withParents(entries)
	if err != nil {
		return nil, err
	}
	opener := func() (io.ReadCloser, error) {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(writeTar(pw, entries, mtime)) }()
		return pr, nil
	}
	return tarball.LayerFromOpener(opener,
		tarball.WithMediaType(types.OCILayer),
		tarball.WithCompressionLevel(gzip.DefaultCompression),
		tarball.WithCompressedCaching)
}
