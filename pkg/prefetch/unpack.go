package prefetch

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

// Limits on packed layers, which come from the network (verified against
// their digest, but written by whoever pushed them).
const (
	// MaxUnpackEntries is the most tar entries (files, directories and
	// others) one archive layer may hold.
	MaxUnpackEntries = 100_000
	// maxZstdWindow bounds the memory a zstd frame may ask the decoder for:
	// 128 MiB, the largest window the reference zstd decodes by default.
	maxZstdWindow = 128 << 20
)

// Unpack reads a packed layer's blob from r and stores the files it holds
// through put, which stores one file's bytes (in the cache) and returns its
// descriptor. It returns the files, with their paths in the model. put is
// given each file's declared size: a tar entry's, or -1 for a layer that is
// one file (it declares none).
//
// The blob is decompressed as layer.Compression says. A layer that is not an
// Archive is one file: its decompressed bytes are the file at layer.Path. An
// Archive layer is a tar archive whose regular files are stored at
// layer.Path/<name>, streamed, never buffered whole. Directories and the
// archive's global headers are skipped; anything else (symbolic and hard
// links, devices, FIFOs, sparse files), absolute names, names with ".."
// segments, names that are not valid model paths, duplicates, a name that is
// both a file and a directory and archives of more than MaxUnpackEntries
// entries are rejected. Such errors, and corrupt compressed or tar data, wrap
// content.ErrInvalid and are permanent: the blob was verified, so fetching it
// again cannot help. Errors from put are returned as they are, with the
// file's path.
//
// Decompressed bytes are bounded by put: a tar entry's reader ends at its
// declared size, and cache.Store.Put stores no more than that, nor more
// than the cache can hold, so that a small layer that decompresses to
// terabytes (a decompression bomb) cannot fill the disk.
func Unpack(ctx context.Context, r io.Reader, layer source.PackedLayer, put func(path string, r io.Reader, size int64) (content.Descriptor, error)) ([]content.File, error) {
	files, err := unpack(ctx, r, layer, put)
	if err != nil {
		return nil, fmt.Errorf("unpacking layer %s (%s): %w", layer.Digest, layer.MediaType, err)
	}
	return files, nil
}

func unpack(ctx context.Context, r io.Reader, layer source.PackedLayer, put func(string, io.Reader, int64) (content.Descriptor, error)) ([]content.File, error) {
	switch {
	case layer.Archive && layer.Path != "":
		if err := content.ValidatePath(layer.Path); err != nil {
			return nil, content.Permanent(fmt.Errorf("archive directory: %w", err))
		}
	case !layer.Archive:
		if err := content.ValidatePath(layer.Path); err != nil {
			return nil, content.Permanent(fmt.Errorf("file path: %w", err))
		}
	}
	r = sourceReader{ctx: ctx, r: r}
	dr, err := decompress(r, layer.Compression)
	if err != nil {
		return nil, err
	}
	defer dr.Close()
	if !layer.Archive {
		desc, err := put(layer.Path, invalidOnError{dr}, -1)
		if err != nil {
			return nil, fmt.Errorf("storing %s: %w", layer.Path, classifyStreamErr(err))
		}
		return []content.File{{Path: layer.Path, Descriptor: desc}}, nil
	}
	return untar(ctx, invalidOnError{dr}, layer.Path, put)
}

// untar stores the regular files of the tar stream r under dir.
func untar(ctx context.Context, r io.Reader, dir string, put func(string, io.Reader, int64) (content.Descriptor, error)) ([]content.File, error) {
	tr := tar.NewReader(r)
	var (
		files []content.File
		seen  = make(map[string]bool)
	)
	for entries := 0; ; entries++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, classifyStreamErr(fmt.Errorf("reading tar entry %d: %w", entries+1, err))
		}
		if entries >= MaxUnpackEntries {
			return nil, invalid("more than %d tar entries", MaxUnpackEntries)
		}
		switch hdr.Typeflag {
		case tar.TypeXGlobalHeader:
			continue
		case tar.TypeDir:
			if _, err := entryPath(dir, hdr.Name); err != nil {
				return nil, err
			}
			continue
		case tar.TypeReg:
		default:
			return nil, invalid("tar entry %q is a %s: only regular files and directories are allowed", truncate(hdr.Name), typeName(hdr.Typeflag))
		}
		p, err := entryPath(dir, hdr.Name)
		if err != nil {
			return nil, err
		}
		if p == dir {
			return nil, invalid("tar entry %q is a file where the layer's directory is", truncate(hdr.Name))
		}
		if seen[p] {
			return nil, invalid("tar entry %q: duplicate file %q", truncate(hdr.Name), p)
		}
		seen[p] = true
		desc, err := put(p, tr, hdr.Size)
		if err != nil {
			return nil, fmt.Errorf("storing %s: %w", p, classifyStreamErr(err))
		}
		if desc.Size != hdr.Size {
			return nil, fmt.Errorf("storing %s: stored %d bytes of a tar entry of %d: %w", p, desc.Size, hdr.Size, content.ErrSizeMismatch)
		}
		files = append(files, content.File{Path: p, Descriptor: desc})
	}
	// A file may not also be a directory of another: "a" and "a/b".
	for _, f := range files {
		for d := path.Dir(f.Path); d != "." && d != dir; d = path.Dir(d) {
			if seen[d] {
				return nil, invalid("%q is both a file and a directory", d)
			}
		}
	}
	return files, nil
}

// entryPath maps a tar entry's name to its path in the model: under dir,
// relative, clean, no "..". The archive's root ("." or "./") maps to dir.
func entryPath(dir, name string) (string, error) {
	if strings.HasPrefix(name, "/") {
		return "", invalid("tar entry %q is an absolute path", truncate(name))
	}
	for seg := range strings.SplitSeq(name, "/") {
		if seg == ".." {
			return "", invalid("tar entry %q leaves the layer's directory", truncate(name))
		}
	}
	p := path.Join(dir, name)
	if p == "." || p == dir {
		return dir, nil
	}
	if err := content.ValidatePath(p); err != nil {
		return "", content.Permanent(fmt.Errorf("tar entry %q: %w", truncate(name), err))
	}
	return p, nil
}

func typeName(t byte) string {
	switch t {
	case tar.TypeSymlink:
		return "symbolic link"
	case tar.TypeLink:
		return "hard link"
	case tar.TypeChar:
		return "character device"
	case tar.TypeBlock:
		return "block device"
	case tar.TypeFifo:
		return "FIFO"
	case tar.TypeGNUSparse:
		return "sparse file"
	default:
		return fmt.Sprintf("entry of type %q", t)
	}
}

// decompress returns a reader of r's bytes decompressed as c says.
func decompress(r io.Reader, c source.Compression) (io.ReadCloser, error) {
	switch c {
	case source.CompressionNone:
		return io.NopCloser(r), nil
	case source.CompressionGzip:
		zr, err := gzip.NewReader(r)
		if err != nil {
			var se *sourceError
			if errors.As(err, &se) {
				return nil, err
			}
			return nil, invalidData("gzip header", err)
		}
		return zr, nil
	case source.CompressionZstd:
		zr, err := zstd.NewReader(r, zstd.WithDecoderMaxWindow(maxZstdWindow), zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, invalidData("zstd", err)
		}
		return zstdCloser{zr}, nil
	default:
		return nil, invalid("unknown compression %q", c)
	}
}

type zstdCloser struct{ *zstd.Decoder }

func (z zstdCloser) Close() error { z.Decoder.Close(); return nil }

// sourceReader reads the layer's blob, stops once ctx is done, and marks its
// errors as the source's, so that they are not taken for corrupt data.
type sourceReader struct {
	ctx context.Context
	r   io.Reader
}

func (s sourceReader) Read(p []byte) (int, error) {
	if err := s.ctx.Err(); err != nil {
		return 0, &sourceError{err}
	}
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		err = &sourceError{err}
	}
	return n, err
}

// sourceError is an error reading the layer's blob itself.
type sourceError struct{ err error }

func (e *sourceError) Error() string { return e.err.Error() }

func (e *sourceError) Unwrap() error { return e.err }

// invalidOnError marks errors of the decompressing reader that do not come
// from the source (corrupt data) as content.ErrInvalid.
type invalidOnError struct{ r io.Reader }

func (i invalidOnError) Read(p []byte) (int, error) {
	n, err := i.r.Read(p)
	var se *sourceError
	if err != nil && err != io.EOF && !errors.As(err, &se) {
		err = &corruptError{err}
	}
	return n, err
}

// corruptError is corrupt compressed data read from the layer.
type corruptError struct{ err error }

func (e *corruptError) Error() string { return "corrupt data: " + e.err.Error() }

func (e *corruptError) Unwrap() []error {
	return []error{e.err, content.ErrInvalid, content.ErrPermanent}
}

// classifyStreamErr marks errors of reading the layer as permanent invalid
// data unless they come from ctx or are already classified; put's own
// errors pass through.
func classifyStreamErr(err error) error {
	var se *sourceError
	if errors.As(err, &se) {
		return err
	}
	var ce *corruptError
	if errors.As(err, &ce) || errors.Is(err, content.ErrInvalid) {
		return content.Permanent(err)
	}
	if errors.Is(err, tar.ErrHeader) || errors.Is(err, tar.ErrInsecurePath) || errors.Is(err, io.ErrUnexpectedEOF) {
		return content.Permanent(fmt.Errorf("%w: %w", content.ErrInvalid, err))
	}
	return err
}

func invalid(format string, args ...any) error {
	return content.Permanent(fmt.Errorf("%w: "+format, append([]any{content.ErrInvalid}, args...)...))
}

func invalidData(what string, err error) error {
	return content.Permanent(fmt.Errorf("%w: %s: %w", content.ErrInvalid, what, err))
}
