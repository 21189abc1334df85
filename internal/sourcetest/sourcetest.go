// Package sourcetest holds the test helpers that the tests of pkg/prefetch
// and of the sources under pkg/source share: generated origins and blobs,
// a cache store and a running queue, and packed (tar, gzip, zstd) layers.
package sourcetest

import (
	"archive/tar"
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source"
)

// BlobData returns n bytes of a fixed pattern and their digest.
func BlobData(n int) ([]byte, digest.Digest) {
	data := make([]byte, n)
	for i := range data {
		data[i] = byte(i*7 + i>>8)
	}
	return data, digest.FromBytes(data)
}

// RunQueue runs q until the test ends.
func RunQueue(t *testing.T, q *prefetch.Queue) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- q.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
	})
}

// Wait waits for the job, failing the test if it takes too long.
func Wait(t *testing.T, j *prefetch.Job) (prefetch.JobStatus, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st, err := j.Wait(ctx)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "job %s stuck in %s", j.ID(), st.State)
	return st, err
}

// OpenStore opens a store in a temporary directory with small chunks, quick
// retries and a short stall timeout, closed when the test ends.
func OpenStore(t *testing.T, opts ...cache.Option) *cache.Store {
	t.Helper()
	opts = append([]cache.Option{cache.WithChunkSize(64 << 10), cache.WithRetries(5, time.Millisecond), cache.WithStallTimeout(2 * time.Second)}, opts...)
	s, err := cache.Open(t.TempDir(), opts...)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// TarEntry is one tar entry of a test archive.
type TarEntry struct {
	Name string
	Type byte
	Body string
	Link string
}

// Reg is a regular file entry.
func Reg(name, body string) TarEntry {
	return TarEntry{Name: name, Type: tar.TypeReg, Body: body}
}

// Dir is a directory entry.
func Dir(name string) TarEntry { return TarEntry{Name: name, Type: tar.TypeDir} }

// Tar is an archive of entries.
func Tar(t testing.TB, entries ...TarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		hdr := &tar.Header{Name: e.Name, Typeflag: e.Type, Mode: 0o644, Linkname: e.Link}
		if e.Type == tar.TypeXGlobalHeader {
			hdr = &tar.Header{Typeflag: e.Type, PAXRecords: map[string]string{"comment": "global"}}
		}
		if e.Type == tar.TypeReg {
			hdr.Size = int64(len(e.Body))
		}
		require.NoError(t, tw.WriteHeader(hdr))
		if e.Type == tar.TypeReg {
			_, err := tw.Write([]byte(e.Body))
			require.NoError(t, err)
		}
	}
	require.NoError(t, tw.Close())
	return buf.Bytes()
}

// Compress compresses data as a packed layer with compression c is.
func Compress(t testing.TB, c source.Compression, data []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	switch c {
	case source.CompressionNone:
		return data
	case source.CompressionGzip:
		zw := gzip.NewWriter(&buf)
		_, err := zw.Write(data)
		require.NoError(t, err)
		require.NoError(t, zw.Close())
	case source.CompressionZstd:
		zw, err := zstd.NewWriter(&buf)
		require.NoError(t, err)
		_, err = zw.Write(data)
		require.NoError(t, err)
		require.NoError(t, zw.Close())
	}
	return buf.Bytes()
}
