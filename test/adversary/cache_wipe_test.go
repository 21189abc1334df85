package adversary

import (
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source/oci"
)

// TestCacheWipeHugeClaimedSize is the cache wipe of issue 21: a blob that
// claims 2^55 bytes (in a model.json, in an answer to HEAD, in an image
// manifest) must fail at once with ErrDiskFull and evict nothing. Before the
// fix the store evicted every unpinned blob to make room for it, then failed
// anyway.
func TestCacheWipeHugeClaimedSize(t *testing.T) {
	t.Parallel()
	const huge = int64(1) << 55
	bait := diskBytes(55, 4096) // what the origin serves for the huge file
	for _, tc := range []struct {
		name string
		ref  func(t *testing.T, o *diskOrigin) string
	}{
		{"model.json", func(t *testing.T, o *diskOrigin) string {
			return o.model(t, "evil/huge", diskFile{path: "config.json", data: []byte("{}")},
				diskFile{path: "model.safetensors", data: bait, size: huge})
		}},
		{"HEAD", func(t *testing.T, o *diskOrigin) string {
			o.put("/evil/model.bin", bait)
			o.lie("/evil/model.bin", huge)
			return o.url("/evil/model.bin") + "#" + digest.FromBytes(bait).String()
		}},
		{"image manifest", func(t *testing.T, _ *diskOrigin) string {
			return diskHugeImage(t, huge)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			store, reg := diskStore(t, t.TempDir(), cache.WithBudget(64<<20, 0))
			q := diskQueue(t, store)
			o := newDiskOrigin(t)
			before := diskSeed(t, q, o, store, "victim/small", 4, 1<<20)

			st, err := diskFetch(t, q, tc.ref(t, o))
			t.Logf("refused: %v", err)
			require.ErrorIs(t, err, cache.ErrDiskFull)
			require.Equal(t, prefetch.StateFailed, st.State)
			require.Contains(t, st.Error, fmt.Sprint(huge), "the error names the size")

			require.Zero(t, diskMetric(t, reg, "weightd_cache_evictions_total"), "nothing is evicted for a blob that can never fit")
			diskRequireIntact(t, store, before)
			u := store.Usage()
			require.Less(t, u.PartialBytes, int64(64<<10), "the refused reservation is released (small siblings cancelled mid-way stay as partials)")
			require.LessOrEqual(t, u.Bytes, int64(len(before))<<20+64<<10,
				"the victim's blobs, and at most the small ones of the attack (config.json; the image's manifest and config)")
		})
	}
}

// diskHugeImage pushes an image whose one layer claims huge bytes to an
// in-memory registry and returns its oci:// reference.
func diskHugeImage(t *testing.T, huge int64) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	repo, err := name.NewRepository(host + "/evil/app")
	require.NoError(t, err)
	cfg := []byte(`{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}`)
	require.NoError(t, remote.WriteLayer(repo, static.NewLayer(cfg, types.OCIConfigJSON)))
	manifest := fmt.Sprintf(`{"schemaVersion":2,"mediaType":%q,`+
		`"config":{"mediaType":%q,"digest":%q,"size":%d},`+
		`"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":%q,"size":%d}]}`,
		oci.MediaTypeOCIManifest, oci.MediaTypeOCIConfig, digest.FromBytes(cfg), len(cfg),
		digest.FromString("never served"), huge)
	tag, err := name.NewTag(host + "/evil/app:v1")
	require.NoError(t, err)
	require.NoError(t, remote.Put(tag, diskRawManifest{[]byte(manifest), oci.MediaTypeOCIManifest}))
	return "oci://" + host + "/evil/app:v1"
}

// diskRawManifest is a manifest to push as it is.
type diskRawManifest struct {
	body []byte
	mt   string
}

func (m diskRawManifest) RawManifest() ([]byte, error)        { return m.body, nil }
func (m diskRawManifest) MediaType() (types.MediaType, error) { return types.MediaType(m.mt), nil }
