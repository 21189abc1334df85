package cache_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

func TestPut(t *testing.T) {
	t.Parallel()
	s, err := cache.Open(t.TempDir(), cache.WithChunkSize(64<<10))
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	data := make([]byte, 300<<10)
	rand.Read(data)

	info, err := s.Put(t.Context(), bytes.NewReader(data), int64(len(data)))
	require.NoError(t, err)
	assert.Equal(t, digest.FromBytes(data), info.Digest)
	assert.Equal(t, int64(len(data)), info.Size)
	f, err := s.Open(info.Digest)
	require.NoError(t, err)
	got, err := os.ReadFile(f.Name())
	f.Close()
	require.NoError(t, err)
	assert.Equal(t, data, got)

	// Again, with no declared size: the same blob, nothing new.
	again, err := s.Put(t.Context(), bytes.NewReader(data), -1)
	require.NoError(t, err)
	assert.Equal(t, info.Digest, again.Digest)
	assert.Len(t, s.List(), 1)
	// No spool file is left behind.
	entries, err := os.ReadDir(s.Root() + "/partial")
	require.NoError(t, err)
	assert.Empty(t, entries)
}

func TestPutCancelled(t *testing.T) {
	t.Parallel()
	s, err := cache.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = s.Put(ctx, bytes.NewReader(make([]byte, 1<<20)), -1)
	require.True(t, errors.Is(err, context.Canceled), "%v", err)
	assert.Empty(t, s.List())
}

// TestPutBounded checks that Put writes no more than the content's declared
// size nor more than the store can hold: a decompression bomb stops there.
func TestPutBounded(t *testing.T) {
	t.Parallel()
	const budget = 4 << 20
	s, err := cache.Open(t.TempDir(), cache.WithChunkSize(64<<10), cache.WithBudget(budget, 0))
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	old, err := s.Put(t.Context(), bytes.NewReader(make([]byte, 1<<20)), 1<<20)
	require.NoError(t, err)

	// Declared larger than the budget: refused before a byte is read.
	r := &countingReader{r: zeros{}}
	_, err = s.Put(t.Context(), r, budget+1)
	require.ErrorIs(t, err, cache.ErrDiskFull)
	assert.Zero(t, r.n, "nothing is read of what cannot fit")

	// Longer than declared: stopped one byte past it.
	r = &countingReader{r: zeros{}}
	_, err = s.Put(t.Context(), r, 1000)
	require.ErrorIs(t, err, content.ErrSizeMismatch)
	assert.LessOrEqual(t, r.n, int64(1000+32<<10), "read about the declared size, no more")

	// Shorter than declared.
	_, err = s.Put(t.Context(), bytes.NewReader(make([]byte, 10)), 11)
	require.ErrorIs(t, err, content.ErrSizeMismatch)

	// No declared size: bounded by the room left under the budget.
	r = &countingReader{r: zeros{}}
	_, err = s.Put(t.Context(), r, -1)
	require.ErrorIs(t, err, cache.ErrDiskFull)
	assert.LessOrEqual(t, r.n, int64(budget), "read no more than the budget")

	_, err = s.Stat(old.Digest)
	require.NoError(t, err, "nothing was evicted")
	assert.Zero(t, s.Usage().PartialBytes, "every spool reservation is released")
	entries, err := os.ReadDir(s.Root() + "/partial")
	require.NoError(t, err)
	assert.Empty(t, entries, "no spool file is left behind")
}

// zeros reads zeros forever.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// countingReader counts the bytes read from r.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func TestBytesOpener(t *testing.T) {
	t.Parallel()
	r, err := cache.Bytes("hello").OpenRange(t.Context(), 2)
	require.NoError(t, err)
	var buf bytes.Buffer
	_, err = buf.ReadFrom(r)
	require.NoError(t, err)
	assert.Equal(t, "llo", buf.String())
	_, err = cache.Bytes("hello").OpenRange(t.Context(), 6)
	assert.ErrorIs(t, err, content.ErrPermanent)
}
