package mirror

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestTagStore(t *testing.T) {
	t.Parallel()
	good := tagEntry{Digest: digest.Digest("sha256:" + hex64), MediaType: mediaTypeOCIManifest, Updated: time.Now().UTC()}
	tests := []struct {
		name    string
		file    string // the file there before; "" for none
		want    map[string]tagEntry
		corrupt bool // set aside
	}{
		{name: "none", want: map[string]tagEntry{}},
		{name: "corrupt", file: "{not json", want: map[string]tagEntry{}, corrupt: true},
		{name: "bad entries dropped", file: `{
			"docker.io/library/app:v1": {"digest": "sha256:` + hex64 + `", "mediaType": "` + mediaTypeOCIManifest + `"},
			"docker.io/../etc:v1": {"digest": "sha256:` + hex64 + `", "mediaType": "` + mediaTypeOCIManifest + `"},
			"docker.io/library/app:v2": {"digest": "md5:abc", "mediaType": "` + mediaTypeOCIManifest + `"},
			"docker.io/library/app:v3": {"digest": "sha256:` + hex64 + `", "mediaType": "text/plain\r\nX-Evil: 1"}
		}`, want: map[string]tagEntry{"docker.io/library/app:v1": {Digest: good.Digest, MediaType: mediaTypeOCIManifest}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			if tt.file != "" {
				require.NoError(t, os.WriteFile(filepath.Join(dir, tagsFile), []byte(tt.file), 0o644))
			}
			ts, err := openTagStore(dir)
			require.NoError(t, err)
			assert.Equal(t, tt.want, ts.m)
			if tt.corrupt {
				assert.FileExists(t, filepath.Join(dir, tagsFile+".corrupt"))
			}
			// A put persists; a fresh store reads it back.
			require.NoError(t, ts.put(tagKey("docker.io", "library/app", "latest"), good))
			again, err := openTagStore(dir)
			require.NoError(t, err)
			e, ok := again.get(tagKey("docker.io", "library/app", "latest"))
			require.True(t, ok)
			assert.Equal(t, good.Digest, e.Digest)
			assert.True(t, good.Updated.Equal(e.Updated))
		})
	}
}

func TestTagStoreBounded(t *testing.T) {
	t.Parallel()
	ts, err := openTagStore("")
	require.NoError(t, err)
	base := time.Now()
	for i := range maxTags + 10 {
		require.NoError(t, ts.put(tagKey("docker.io", "app", "t"+strconv.Itoa(i)),
			tagEntry{Digest: digest.Digest("sha256:" + hex64), MediaType: mediaTypeOCIManifest, Updated: base.Add(time.Duration(i) * time.Second)}))
	}
	assert.Len(t, ts.m, maxTags)
	_, ok := ts.get(tagKey("docker.io", "app", "t0"))
	assert.False(t, ok, "the oldest went first")
}

func TestKnownBlobsBounded(t *testing.T) {
	t.Parallel()
	k := newKnownBlobs(3)
	ds := []digest.Digest{digest.FromString("a"), digest.FromString("b"), digest.FromString("c"), digest.FromString("d")}
	for i, d := range ds {
		k.put(d, knownBlob{Size: int64(i)})
	}
	_, ok := k.get(ds[0])
	assert.False(t, ok)
	b, ok := k.get(ds[3])
	require.True(t, ok)
	assert.Equal(t, int64(3), b.Size)
	k.forget(ds[3])
	_, ok = k.get(ds[3])
	assert.False(t, ok)
}
