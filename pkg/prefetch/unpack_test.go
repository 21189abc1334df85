package prefetch_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source"
)

// memPut is a put function that keeps files in memory.
type memPut struct {
	mu    sync.Mutex
	files map[string][]byte
}

func (m *memPut) put(p string, r io.Reader, size int64) (content.Descriptor, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return content.Descriptor{}, err
	}
	if size >= 0 && int64(len(data)) != size {
		return content.Descriptor{}, fmt.Errorf("%s: %d bytes, %d declared", p, len(data), size)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.files == nil {
		m.files = make(map[string][]byte)
	}
	m.files[p] = data
	return content.Descriptor{Digest: digest.FromBytes(data), Size: int64(len(data))}, nil
}

func TestUnpack(t *testing.T) {
	t.Parallel()
	archive := func(t *testing.T) []byte {
		return sourcetest.Tar(t,
			sourcetest.Dir("./"), sourcetest.Dir("sub/"), sourcetest.Reg("./config.json", `{"a":1}`), sourcetest.Reg("sub/model.safetensors", strings.Repeat("w", 10000)),
			sourcetest.Reg("empty", ""), sourcetest.TarEntry{Name: "g", Type: tar.TypeXGlobalHeader})
	}
	wantArchive := map[string]string{"config.json": `{"a":1}`, "sub/model.safetensors": strings.Repeat("w", 10000), "empty": ""}
	for _, tc := range []struct {
		name    string
		c       source.Compression
		archive bool
		path    string
		want    map[string]string
	}{
		{"raw", source.CompressionNone, false, "weights/model.bin", map[string]string{"weights/model.bin": "raw bytes"}},
		{"gzip file", source.CompressionGzip, false, "model.bin", map[string]string{"model.bin": "raw bytes"}},
		{"zstd file", source.CompressionZstd, false, "model.bin", map[string]string{"model.bin": "raw bytes"}},
		{"tar", source.CompressionNone, true, "", wantArchive},
		{"tar+gzip", source.CompressionGzip, true, "", wantArchive},
		{"tar+zstd", source.CompressionZstd, true, "", wantArchive},
		{"tar under a directory", source.CompressionNone, true, "docs/v1", map[string]string{
			"docs/v1/config.json": `{"a":1}`, "docs/v1/sub/model.safetensors": strings.Repeat("w", 10000), "docs/v1/empty": ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			data := []byte("raw bytes")
			if tc.archive {
				data = archive(t)
			}
			blob := sourcetest.Compress(t, tc.c, data)
			var m memPut
			files, err := prefetch.Unpack(t.Context(), bytes.NewReader(blob), source.PackedLayer{
				Descriptor:  content.Descriptor{Digest: digest.FromBytes(blob), Size: int64(len(blob))},
				Compression: tc.c, Archive: tc.archive, Path: tc.path,
			}, m.put)
			require.NoError(t, err)
			require.Len(t, files, len(tc.want))
			for _, f := range files {
				want, ok := tc.want[f.Path]
				require.True(t, ok, f.Path)
				assert.Equal(t, digest.FromString(want), f.Digest, f.Path)
				assert.Equal(t, int64(len(want)), f.Size, f.Path)
				assert.Equal(t, want, string(m.files[f.Path]), f.Path)
			}
		})
	}
}

func TestUnpackRejects(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		entries []sourcetest.TarEntry
		path    string
		want    string
	}{
		{"symlink", []sourcetest.TarEntry{{Name: "link", Type: tar.TypeSymlink, Link: "/etc/passwd"}}, "", "symbolic link"},
		{"hard link", []sourcetest.TarEntry{sourcetest.Reg("a", "x"), {Name: "b", Type: tar.TypeLink, Link: "a"}}, "", "hard link"},
		{"char device", []sourcetest.TarEntry{{Name: "tty", Type: tar.TypeChar}}, "", "character device"},
		{"block device", []sourcetest.TarEntry{{Name: "sda", Type: tar.TypeBlock}}, "", "block device"},
		{"fifo", []sourcetest.TarEntry{{Name: "pipe", Type: tar.TypeFifo}}, "", "FIFO"},
		{"absolute", []sourcetest.TarEntry{sourcetest.Reg("/etc/passwd", "x")}, "", "absolute"},
		{"dot dot", []sourcetest.TarEntry{sourcetest.Reg("a/../../b", "x")}, "", "leaves"},
		{"dot dot under a directory", []sourcetest.TarEntry{sourcetest.Reg("../b", "x")}, "sub", "leaves"},
		{"dot dot directory", []sourcetest.TarEntry{sourcetest.Dir("../")}, "", "leaves"},
		{"backslash", []sourcetest.TarEntry{sourcetest.Reg(`a\b`, "x")}, "", "backslash"},
		{"root file", []sourcetest.TarEntry{sourcetest.Reg(".", "x")}, "", "layer's directory"},
		{"directory file", []sourcetest.TarEntry{sourcetest.Reg("./.", "x")}, "sub", "layer's directory"},
		{"duplicate", []sourcetest.TarEntry{sourcetest.Reg("a", "x"), sourcetest.Reg("./a", "y")}, "", "duplicate"},
		{"file and directory", []sourcetest.TarEntry{sourcetest.Reg("a", "x"), sourcetest.Reg("a/b", "y")}, "", "both a file and a directory"},
		{"bad directory", []sourcetest.TarEntry{sourcetest.Reg("a", "x")}, "../up", "not clean"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			blob := sourcetest.Tar(t, tc.entries...)
			var m memPut
			_, err := prefetch.Unpack(t.Context(), bytes.NewReader(blob), source.PackedLayer{Archive: true, Path: tc.path}, m.put)
			require.Error(t, err)
			assert.ErrorContains(t, err, tc.want)
			assert.ErrorIs(t, err, content.ErrInvalid)
			assert.ErrorIs(t, err, content.ErrPermanent)
			for p := range m.files {
				assert.NoError(t, content.ValidatePath(p))
				assert.False(t, strings.HasPrefix(p, ".."), p)
			}
		})
	}
}

func TestUnpackCorrupt(t *testing.T) {
	t.Parallel()
	tarball := sourcetest.Tar(t, sourcetest.Reg("a", strings.Repeat("x", 5000)))
	gz := sourcetest.Compress(t, source.CompressionGzip, tarball)
	zs := sourcetest.Compress(t, source.CompressionZstd, tarball)
	flip := func(b []byte, i int) []byte {
		c := bytes.Clone(b)
		c[i] ^= 0xff
		return c
	}
	for _, tc := range []struct {
		name    string
		blob    []byte
		c       source.Compression
		archive bool
	}{
		{"not gzip", []byte("plain"), source.CompressionGzip, true},
		{"empty gzip", nil, source.CompressionGzip, false},
		{"gzip body flipped", flip(gz, len(gz)/2), source.CompressionGzip, true},
		{"gzip truncated", gz[:len(gz)/2], source.CompressionGzip, true},
		{"gzip checksum", flip(gz, len(gz)-6), source.CompressionGzip, false},
		{"not zstd", []byte("plain text"), source.CompressionZstd, true},
		{"zstd truncated", zs[:len(zs)/2], source.CompressionZstd, false},
		{"tar truncated", tarball[:700], source.CompressionNone, true},
		{"tar header garbage", bytes.Repeat([]byte{'z'}, 1024), source.CompressionNone, true},
		{"unknown compression", tarball, source.Compression("lz4"), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var m memPut
			_, err := prefetch.Unpack(t.Context(), bytes.NewReader(tc.blob), source.PackedLayer{Compression: tc.c, Archive: tc.archive, Path: "f"}, m.put)
			require.Error(t, err)
			assert.ErrorIs(t, err, content.ErrInvalid)
			assert.ErrorIs(t, err, content.ErrPermanent)
		})
	}
}

func TestUnpackEntryLimit(t *testing.T) {
	t.Parallel()
	pr, pw := io.Pipe()
	go func() {
		tw := tar.NewWriter(pw)
		for i := range prefetch.MaxUnpackEntries + 1 {
			if err := tw.WriteHeader(&tar.Header{Name: "d" + strings.Repeat("x", i%7) + "/", Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
				pw.CloseWithError(err)
				return
			}
		}
		pw.CloseWithError(tw.Close())
	}()
	var m memPut
	_, err := prefetch.Unpack(t.Context(), pr, source.PackedLayer{Archive: true}, m.put)
	pr.Close()
	assert.ErrorIs(t, err, content.ErrInvalid)
	assert.ErrorContains(t, err, "more than")
}

func TestUnpackPutAndSourceErrors(t *testing.T) {
	t.Parallel()
	blob := sourcetest.Tar(t, sourcetest.Reg("a", "x"), sourcetest.Reg("b", "y"))

	t.Run("put", func(t *testing.T) {
		t.Parallel()
		errFull := errors.New("disk full")
		_, err := prefetch.Unpack(t.Context(), bytes.NewReader(blob), source.PackedLayer{Archive: true},
			func(string, io.Reader, int64) (content.Descriptor, error) { return content.Descriptor{}, errFull })
		assert.ErrorIs(t, err, errFull)
		assert.NotErrorIs(t, err, content.ErrPermanent)
		assert.ErrorContains(t, err, "storing a")
	})
	t.Run("source", func(t *testing.T) {
		t.Parallel()
		errIO := errors.New("input/output error")
		gz := sourcetest.Compress(t, source.CompressionGzip, blob)
		r := io.MultiReader(bytes.NewReader(gz[:20]), iotestErrReader{errIO})
		var m memPut
		_, err := prefetch.Unpack(t.Context(), r, source.PackedLayer{Archive: true, Compression: source.CompressionGzip}, m.put)
		assert.ErrorIs(t, err, errIO)
		assert.NotErrorIs(t, err, content.ErrInvalid)
	})
	t.Run("canceled", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		var m memPut
		_, err := prefetch.Unpack(ctx, bytes.NewReader(blob), source.PackedLayer{Archive: true}, m.put)
		assert.ErrorIs(t, err, context.Canceled)
		assert.NotErrorIs(t, err, content.ErrInvalid)
		assert.Empty(t, m.files)
	})
	t.Run("bad file path", func(t *testing.T) {
		t.Parallel()
		var m memPut
		_, err := prefetch.Unpack(t.Context(), strings.NewReader("x"), source.PackedLayer{Path: ""}, m.put)
		assert.ErrorIs(t, err, content.ErrInvalid)
		assert.Empty(t, m.files)
	})
}

type iotestErrReader struct{ err error }

func (r iotestErrReader) Read([]byte) (int, error) { return 0, r.err }

// FuzzUnpack feeds arbitrary bytes through each compression and archive mode:
// bad input must be an error, never a panic, and nothing may be stored
// outside the layer's directory.
func FuzzUnpack(f *testing.F) {
	f.Add(sourcetest.Tar(f, sourcetest.Reg("a", "x"), sourcetest.Dir("d/"), sourcetest.Reg("d/b", "yy")), uint8(0))
	f.Add(sourcetest.Compress(f, source.CompressionGzip, sourcetest.Tar(f, sourcetest.Reg("a", "x"))), uint8(1))
	f.Add(sourcetest.Compress(f, source.CompressionZstd, sourcetest.Tar(f, sourcetest.Reg("a", "x"))), uint8(2))
	f.Add(sourcetest.Tar(f, sourcetest.Reg("../a", "x")), uint8(4))
	f.Add(sourcetest.Compress(f, source.CompressionGzip, []byte("file")), uint8(5))
	f.Fuzz(func(t *testing.T, data []byte, mode uint8) {
		layer := source.PackedLayer{
			Compression: []source.Compression{source.CompressionNone, source.CompressionGzip, source.CompressionZstd}[mode%3],
			Archive:     mode&4 == 0,
			Path:        "model",
		}
		if !layer.Archive {
			layer.Path = "model/file"
		}
		var stored []string
		files, err := prefetch.Unpack(t.Context(), bytes.NewReader(data), layer, func(p string, r io.Reader, _ int64) (content.Descriptor, error) {
			stored = append(stored, p)
			// Stop at 1 MiB: a tiny zstd input may decompress to gigabytes.
			n, err := io.Copy(io.Discard, io.LimitReader(r, 1<<20+1))
			if err == nil && n > 1<<20 {
				err = errors.New("file too large for the fuzz test")
			}
			return content.Descriptor{Digest: digest.FromString(p), Size: n}, err
		})
		for _, p := range stored {
			if content.ValidatePath(p) != nil || (p != layer.Path && !strings.HasPrefix(p, layer.Path+"/")) || path.Clean(p) != p {
				t.Fatalf("stored %q outside %q", p, layer.Path)
			}
		}
		if err != nil {
			return
		}
		seen := make(map[string]bool)
		for _, f := range files {
			if seen[f.Path] {
				t.Fatalf("duplicate %q", f.Path)
			}
			seen[f.Path] = true
		}
	})
}

// BenchmarkUnpack measures decompressing and untarring a layer of one
// 16 MiB file, per compression (put discards the bytes).
func BenchmarkUnpack(b *testing.B) {
	const size = 16 << 20
	body := make([]byte, size)
	for i := range body {
		body[i] = byte(i * 131 >> 7) // compressible, not trivially
	}
	archive := sourcetest.Tar(b, sourcetest.Reg("model.safetensors", string(body)))
	for _, c := range []source.Compression{source.CompressionNone, source.CompressionGzip, source.CompressionZstd} {
		blob := sourcetest.Compress(b, c, archive)
		name := string(c)
		if name == "" {
			name = "none"
		}
		b.Run(name, func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				_, err := prefetch.Unpack(b.Context(), bytes.NewReader(blob), source.PackedLayer{Compression: c, Archive: true},
					func(_ string, r io.Reader, _ int64) (content.Descriptor, error) {
						n, err := io.Copy(io.Discard, r)
						return content.Descriptor{Size: n}, err
					})
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
