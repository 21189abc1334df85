package containerd_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

// fixture is an image built by hand, its blobs in a cache store.
type fixture struct {
	img     *source.Image
	diffIDs []digest.Digest
	config  digest.Digest
	layers  []digest.Digest
}

// fileOpener serves a blob from a file.
type fileOpener struct{ path string }

func (o fileOpener) OpenRange(_ context.Context, off int64) (io.ReadCloser, error) {
	f, err := os.Open(o.path)
	if err != nil {
		return nil, err
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

type bytesOpener []byte

func (b bytesOpener) OpenRange(_ context.Context, off int64) (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(b[off:])), nil
}

// put stores b in the cache and returns its blob.
func put(t testing.TB, s *cache.Store, mediaType string, b []byte) source.ImageBlob {
	t.Helper()
	d := content.Descriptor{Digest: digest.FromBytes(b), Size: int64(len(b))}
	_, err := s.Fetch(t.Context(), d, bytesOpener(b), nil)
	require.NoError(t, err)
	return source.ImageBlob{Descriptor: d, MediaType: mediaType}
}

// gzipLayer is a gzip tar layer of a few small files; its files depend on
// seed. It returns the compressed layer and its diff ID.
func gzipLayer(t testing.TB, seed uint64, files int) ([]byte, digest.Digest) {
	t.Helper()
	var tarBuf bytes.Buffer
	tw := tar.NewWriter(&tarBuf)
	r := rand.New(rand.NewPCG(seed, seed))
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("layer%d/", seed), Typeflag: tar.TypeDir, Mode: 0o755, ModTime: time.Unix(0, 0)}))
	for i := range files {
		data := make([]byte, 1000+r.IntN(50000))
		for j := range data {
			data[j] = byte(r.Uint32())
		}
		require.NoError(t, tw.WriteHeader(&tar.Header{
			Name: fmt.Sprintf("layer%d/file%d", seed, i), Typeflag: tar.TypeReg, Mode: 0o644,
			Size: int64(len(data)), ModTime: time.Unix(0, 0),
		}))
		_, err := tw.Write(data)
		require.NoError(t, err)
	}
	require.NoError(t, tw.Close())
	diffID := digest.FromBytes(tarBuf.Bytes())
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, err := zw.Write(tarBuf.Bytes())
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	return gz.Bytes(), diffID
}

// bigTarLayer writes an uncompressed tar layer of one file of size random
// bytes into dir, streaming, and stores it in the cache.
func bigTarLayer(t testing.TB, s *cache.Store, dir string, size int64) (source.ImageBlob, digest.Digest) {
	t.Helper()
	path := filepath.Join(dir, "big.tar")
	f, err := os.Create(path)
	require.NoError(t, err)
	h := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(f, h))
	require.NoError(t, tw.WriteHeader(&tar.Header{Name: "big.bin", Typeflag: tar.TypeReg, Mode: 0o644, Size: size, ModTime: time.Unix(0, 0)}))
	src := rand.NewChaCha8([32]byte{42})
	buf := make([]byte, 1<<20)
	for left := size; left > 0; {
		n := min(left, int64(len(buf)))
		_, _ = src.Read(buf[:n])
		_, err := tw.Write(buf[:n])
		require.NoError(t, err)
		left -= n
	}
	require.NoError(t, tw.Close())
	fi, err := f.Stat()
	require.NoError(t, err)
	require.NoError(t, f.Close())
	d := content.Descriptor{Digest: digest.NewDigest(digest.SHA256, h), Size: fi.Size()}
	_, err = s.Fetch(t.Context(), d, fileOpener{path}, nil)
	require.NoError(t, err)
	require.NoError(t, os.Remove(path))
	return source.ImageBlob{Descriptor: d, MediaType: ocispec.MediaTypeImageLayer}, d.Digest
}

// fixtureOpts shape newFixture's image.
type fixtureOpts struct {
	layers   int   // gzip layers of small files
	bigLayer int64 // if > 0, one more uncompressed layer of this many bytes
	index    bool  // wrap the manifest in an index with a second platform's manifest (absent)
	seed     uint64
	// badDiffID makes the config lie about the first layer's diff ID, so
	// that unpacking fails.
	badDiffID bool
}

func newFixture(t testing.TB, store *cache.Store, name string, o fixtureOpts) *fixture {
	t.Helper()
	fx := &fixture{}
	var layerBlobs []source.ImageBlob
	for i := range o.layers {
		b, diffID := gzipLayer(t, o.seed*100+uint64(i), 3)
		layerBlobs = append(layerBlobs, put(t, store, ocispec.MediaTypeImageLayerGzip, b))
		fx.diffIDs = append(fx.diffIDs, diffID)
	}
	if o.bigLayer > 0 {
		b, diffID := bigTarLayer(t, store, t.TempDir(), o.bigLayer)
		layerBlobs = append(layerBlobs, b)
		fx.diffIDs = append(fx.diffIDs, diffID)
	}
	diffIDs := append([]digest.Digest(nil), fx.diffIDs...)
	if o.badDiffID {
		diffIDs[0] = digest.FromString("not the layer")
	}
	cfg := ocispec.Image{
		Platform: ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH},
		Config:   ocispec.ImageConfig{Cmd: []string{"/bin/true"}, Labels: map[string]string{"seed": fmt.Sprint(o.seed)}},
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: diffIDs},
	}
	cfgJSON, err := json.Marshal(cfg)
	require.NoError(t, err)
	cfgBlob := put(t, store, ocispec.MediaTypeImageConfig, cfgJSON)
	fx.config = cfgBlob.Digest

	m := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    ocispec.Descriptor{MediaType: cfgBlob.MediaType, Digest: cfgBlob.Digest, Size: cfgBlob.Size},
	}
	for _, l := range layerBlobs {
		m.Layers = append(m.Layers, ocispec.Descriptor{MediaType: l.MediaType, Digest: l.Digest, Size: l.Size})
		fx.layers = append(fx.layers, l.Digest)
	}
	mJSON, err := json.Marshal(m)
	require.NoError(t, err)
	mBlob := put(t, store, ocispec.MediaTypeImageManifest, mJSON)

	img := &source.Image{Name: name, Target: mBlob}
	if o.index {
		other := []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","other":true}`)
		otherArch := "arm64"
		if runtime.GOARCH == "arm64" {
			otherArch = "amd64"
		}
		idx := ocispec.Index{
			Versioned: specs.Versioned{SchemaVersion: 2},
			MediaType: ocispec.MediaTypeImageIndex,
			Manifests: []ocispec.Descriptor{
				{ // another platform's, not in the cache
					MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromBytes(other), Size: int64(len(other)),
					Platform: &ocispec.Platform{OS: "linux", Architecture: otherArch},
				},
				{
					MediaType: ocispec.MediaTypeImageManifest, Digest: mBlob.Digest, Size: mBlob.Size,
					Platform: &ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH},
				},
			},
		}
		iJSON, err := json.Marshal(idx)
		require.NoError(t, err)
		iBlob := put(t, store, ocispec.MediaTypeImageIndex, iJSON)
		img.Target = iBlob
		img.Blobs = append(img.Blobs, iBlob)
	}
	img.Blobs = append(img.Blobs, mBlob, cfgBlob)
	img.Blobs = append(img.Blobs, layerBlobs...)
	fx.img = img
	return fx
}

func openStore(t testing.TB) *cache.Store {
	t.Helper()
	s, err := cache.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}
