package cache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"os"

	"github.com/opencontainers/go-digest"
)

// Put stores the bytes of r as a blob named by their sha256 and returns its
// descriptor: for content whose digest is only known once it is read, such
// as the files unpacked from a compressed layer. The bytes are spooled to a
// temporary file beside the partial downloads (removed by the next Open if
// the process dies), then stored like any download: within the budget,
// verified, committed atomically. A blob already present is kept as it is.
func (s *Store) Put(ctx context.Context, r io.Reader) (Info, error) {
	tmp, err := os.CreateTemp(partialDir(s.root), "put-*")
	if err != nil {
		return Info{}, fmt.Errorf("spooling blob: %w", err)
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), contextReader{ctx, r})
	if err != nil {
		return Info{}, fmt.Errorf("spooling blob: %w", err)
	}
	desc := Descriptor{Digest: digest.NewDigestFromBytes(digest.SHA256, h.Sum(nil)), Size: n}
	if info, err := s.Stat(desc.Digest); err == nil {
		return info, nil
	}
	return s.Fetch(ctx, desc, fileOpener{tmp}, nil)
}

// contextReader stops reading once ctx ends.
type contextReader struct {
	ctx context.Context
	r   io.Reader
}

func (c contextReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// fileOpener reads ranges of an open file.
type fileOpener struct{ f *os.File }

func (o fileOpener) OpenRange(_ context.Context, off int64) (io.ReadCloser, error) {
	return io.NopCloser(io.NewSectionReader(o.f, off, 1<<62)), nil
}

// Bytes is a RangeOpener over bytes held in memory: a manifest, a small
// file read whole while resolving.
type Bytes []byte

// OpenRange reads b from off.
func (b Bytes) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	return b.OpenBoundedRange(ctx, off, int64(len(b))-off)
}

// OpenBoundedRange reads bytes [off, off+n) of b.
func (b Bytes) OpenBoundedRange(_ context.Context, off, n int64) (io.ReadCloser, error) {
	if off < 0 || n < 0 || off > int64(len(b)) || n > int64(len(b))-off {
		return nil, Permanent(fmt.Errorf("%w: bytes %d+%d outside a blob of %d bytes", ErrInvalid, off, n, len(b)))
	}
	return io.NopCloser(bytes.NewReader(b[off : off+n])), nil
}
