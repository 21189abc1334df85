package cache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// Put stores the bytes of r as a blob named by their sha256 and returns its
// descriptor: for content whose digest is only known once it is read, such
// as the files unpacked from a compressed layer. size is the content's
// declared size (a tar entry's), or negative where none is declared.
//
// What Put writes is bounded, so that content decompressed from a small
// blob cannot fill the disk. Content declared larger than the store could
// hold with every unpinned blob evicted (under the budget, above the
// free-space floor) is refused with ErrDiskFull before a byte is read or
// anything evicted; content longer than its declared size is
// ErrSizeMismatch, read no further than one byte past it. Content of no
// declared size may take only the room the store has now, evicting
// nothing, and is ErrDiskFull past it.
//
// The bytes are spooled to a temporary file beside the partial downloads
// (removed by the next Open if the process dies), counted against the
// budget while they are, then stored like any download: within the budget,
// verified, committed atomically. A blob already present is kept as it is.
func (s *Store) Put(ctx context.Context, r io.Reader, size int64) (Info, error) {
	limit, release, err := s.reserveSpool(size)
	if err != nil {
		if errors.Is(err, ErrDiskFull) {
			s.m.diskFull.Inc()
		}
		return Info{}, fmt.Errorf("spooling blob: %w", err)
	}
	defer release()
	tmp, err := os.CreateTemp(partialDir(s.root), "put-*")
	if err != nil {
		return Info{}, fmt.Errorf("spooling blob: %w", diskErr(err))
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), io.LimitReader(contextReader{ctx, r}, limit+1))
	if err != nil {
		return Info{}, fmt.Errorf("spooling blob: %w", diskErr(err))
	}
	switch {
	case n > limit && size >= 0:
		return Info{}, fmt.Errorf("spooling blob: %w: more than the %d bytes declared", content.ErrSizeMismatch, size)
	case n > limit:
		s.m.diskFull.Inc()
		return Info{}, fmt.Errorf("spooling blob: %w: content of no declared size is larger than the %d bytes the cache has room for", ErrDiskFull, limit)
	case size >= 0 && n != size:
		return Info{}, fmt.Errorf("spooling blob: %w: %d bytes, %d declared", content.ErrSizeMismatch, n, size)
	}
	desc := content.Descriptor{Digest: digest.NewDigestFromBytes(digest.SHA256, h.Sum(nil)), Size: n}
	if info, err := s.Stat(desc.Digest); err == nil {
		return info, nil
	}
	release() // the download reserves room of its own
	return s.Fetch(ctx, desc, fileOpener{tmp}, nil)
}

// reserveSpool counts room for Put's spool file against the budget and the
// free-space floor and returns the most bytes the spool may take: size
// when declared (evicting for it if need be, refusing what can never fit),
// else the room there is now (evicting nothing). release ends the
// reservation; it may be called more than once.
func (s *Store) reserveSpool(size int64) (limit int64, release func(), err error) {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()
	limit = size
	if size < 0 {
		sp, err := s.space()
		if err != nil {
			return 0, nil, err
		}
		s.mu.RLock()
		stored, partial := s.bytesLocked()
		s.mu.RUnlock()
		limit = max(0, min(sp.budget-stored-partial, sp.free-sp.floor))
	}
	s.mu.Lock()
	s.reserved += limit
	s.mu.Unlock()
	release = sync.OnceFunc(func() {
		s.mu.Lock()
		s.reserved -= limit
		s.mu.Unlock()
		s.updateGauges()
	})
	if size >= 0 {
		if err := s.makeRoom(size, ""); err != nil {
			release()
			return 0, nil, err
		}
	}
	s.updateGauges()
	return limit, release, nil
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
		return nil, content.Permanent(fmt.Errorf("%w: bytes %d+%d outside a blob of %d bytes", content.ErrInvalid, off, n, len(b)))
	}
	return io.NopCloser(bytes.NewReader(b[off : off+n])), nil
}
