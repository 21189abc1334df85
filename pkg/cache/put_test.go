package cache_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"os"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
)

func TestPut(t *testing.T) {
	t.Parallel()
	s, err := cache.Open(t.TempDir(), cache.WithChunkSize(64<<10))
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	data := make([]byte, 300<<10)
	rand.Read(data)

	info, err := s.Put(t.Context(), bytes.NewReader(data))
	require.NoError(t, err)
	assert.Equal(t, digest.FromBytes(data), info.Digest)
	assert.Equal(t, int64(len(data)), info.Size)
	f, err := s.Open(info.Digest)
	require.NoError(t, err)
	got, err := os.ReadFile(f.Name())
	f.Close()
	require.NoError(t, err)
	assert.Equal(t, data, got)

	// Again: the same blob, nothing new.
	again, err := s.Put(t.Context(), bytes.NewReader(data))
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
	_, err = s.Put(ctx, bytes.NewReader(make([]byte, 1<<20)))
	require.True(t, errors.Is(err, context.Canceled), "%v", err)
	assert.Empty(t, s.List())
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
	assert.ErrorIs(t, err, cache.ErrPermanent)
}
