package adversary

import (
	"archive/tar"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/oci"
)

// TestDiskFillDecompressionBomb is the disk fill of issue 21: a ModelPack
// layer of a few hundred KiB that decompresses to hundreds of MiB. The
// agent unpacks it (pkg/prefetch/unpack.go) into the cache with Store.Put,
// which spooled whatever came out, without bound, onto the filesystem the
// kubelet and containerd share. Now each file is bounded by its declared
// size (the tar header's) and by what the cache can hold: a file that can
// never fit is refused before a byte is written, and a layer's files
// together cannot pass the budget. Nothing already cached is evicted for
// them, and nothing of them is left beyond the bound.
func TestDiskFillDecompressionBomb(t *testing.T) {
	t.Parallel()
	const budget = 16 << 20
	for _, bomb := range []struct {
		name    string
		entries int
		size    int64
	}{
		{"one huge file", 1, 256 << 20},
		{"many files under the budget each", 20, 12 << 20},
	} {
		for _, c := range []source.Compression{source.CompressionZstd, source.CompressionGzip} {
			t.Run(fmt.Sprintf("%s/%s", bomb.name, c), func(t *testing.T) {
				t.Parallel()
				store, reg := diskStore(t, t.TempDir(), cache.WithBudget(budget, 0))
				q := diskQueue(t, store)
				before := diskSeed(t, q, newDiskOrigin(t), store, "victim/small", 4, 512<<10)
				ingested := diskMetric(t, reg, "weightd_cache_ingest_bytes_total")

				ref := diskBombModel(t, c, bomb.entries, bomb.size)
				spool := diskWatch(t, filepath.Join(store.Root(), "partial"), "put-*")
				st, err := diskFetch(t, q, ref)
				peak := spool()
				t.Logf("refused: %v", err)

				require.ErrorIs(t, err, cache.ErrDiskFull)
				require.Equal(t, prefetch.StateFailed, st.State)
				require.LessOrEqual(t, peak, int64(budget), "a file being unpacked was spooled past the budget")
				written := diskMetric(t, reg, "weightd_cache_ingest_bytes_total") - ingested
				require.LessOrEqual(t, written, float64(budget), "the layer's files were written past the budget")
				leftovers, err := filepath.Glob(filepath.Join(store.Root(), "partial", "put-*"))
				require.NoError(t, err)
				require.Empty(t, leftovers, "spool files left behind")
				require.Zero(t, diskMetric(t, reg, "weightd_cache_evictions_total"), "the bomb evicted the cache")
				diskRequireIntact(t, store, before)
				u := store.Usage()
				require.LessOrEqual(t, u.Bytes+u.PartialBytes, int64(budget))
			})
		}
	}
}

// diskBombModel pushes a ModelPack model whose one layer is a tar of
// entries files of size zero bytes each (but for a counter in the first
// bytes, so that none is the same blob as another), compressed with c, to
// an in-memory registry, and returns its oci:// reference.
func diskBombModel(t *testing.T, c source.Compression, entries int, size int64) string {
	t.Helper()
	var layer bytes.Buffer
	var zw io.WriteCloser
	switch c {
	case source.CompressionZstd:
		enc, err := zstd.NewWriter(&layer, zstd.WithEncoderLevel(zstd.SpeedFastest))
		require.NoError(t, err)
		zw = enc
	case source.CompressionGzip:
		gz, err := gzip.NewWriterLevel(&layer, gzip.BestSpeed)
		require.NoError(t, err)
		zw = gz
	}
	tw := tar.NewWriter(zw)
	zeros := make([]byte, 1<<20)
	for i := range entries {
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("shard-%03d.safetensors", i), Mode: 0o644, Size: size, Typeflag: tar.TypeReg}))
		head := binary.BigEndian.AppendUint64(nil, uint64(i)+1)
		_, err := tw.Write(head)
		require.NoError(t, err)
		for left := size - int64(len(head)); left > 0; left -= int64(len(zeros)) {
			_, err := tw.Write(zeros[:min(left, int64(len(zeros)))])
			require.NoError(t, err)
		}
	}
	require.NoError(t, tw.Close())
	require.NoError(t, zw.Close())
	require.Less(t, layer.Len(), 2<<20, "the bomb is small")

	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	repo, err := name.NewRepository(host + "/evil/bomb")
	require.NoError(t, err)
	push := func(mt string, data []byte) string {
		require.NoError(t, remote.WriteLayer(repo, static.NewLayer(data, types.MediaType(mt))))
		return fmt.Sprintf(`{"mediaType":%q,"digest":%q,"size":%d}`, mt, digest.FromBytes(data), len(data))
	}
	manifest := `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",` +
		`"artifactType":"application/vnd.cnai.model.config.v1+json",` +
		`"config":` + push(oci.MediaTypeModelConfig, []byte(`{}`)) + `,` +
		`"layers":[` + push("application/vnd.cnai.model.weight.v1.tar+"+string(c), layer.Bytes()) + `]}`
	tag, err := name.NewTag(host + "/evil/bomb:v1")
	require.NoError(t, err)
	require.NoError(t, remote.Put(tag, diskRawManifest{[]byte(manifest), oci.MediaTypeOCIManifest}))
	return "oci://" + host + "/evil/bomb:v1"
}
