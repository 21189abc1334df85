package mirror

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/source/oci"
)

// TestContainerdPullThroughMirror pulls an image with a real containerd
// through the mirror, stops the upstream registry, and pulls it again into a
// fresh containerd: the second pull is served from the cache alone. A third,
// with the mirror down and the registry up, falls back to the registry.
func TestContainerdPullThroughMirror(t *testing.T) {
	t.Parallel()
	services.RequireContainerd(t)
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	img, err := services.PushRandomImage(ctx, reg.Addr, "test/app", "v1", 3, 300<<10, nil)
	require.NoError(t, err)

	store, err := cache.Open(t.TempDir(), cache.WithChunkSize(testChunk), cache.WithRetries(2, 10*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	m, err := New(store, oci.New(), WithRegistries(reg.Addr), WithStateDir(t.TempDir()))
	require.NoError(t, err)
	srv := httptest.NewServer(m)
	t.Cleanup(func() { srv.Close(); m.Close() })

	pull := func(name string) {
		t.Helper()
		ctrd := services.NewContainerdT(t, services.ContainerdConfig{})
		require.NoError(t, ConfigureHosts(ctrd.HostsDir, srv.URL, []string{reg.Addr}, ServerURL(reg.Addr, "http://"+reg.Addr)))
		out, err := ctrd.Ctr(ctx, "images", "pull", "--hosts-dir", ctrd.HostsDir, img.Ref)
		require.NoError(t, err, "%s pull: %s", name, out)
		out, err = ctrd.Ctr(ctx, "images", "check")
		require.NoError(t, err)
		assert.Contains(t, string(out), img.Ref, "%s pull", name)
		assert.Contains(t, string(out), "complete", "%s pull", name)
	}

	pull("first")
	served := reg.BytesServed()
	assert.Positive(t, served)
	assert.Positive(t, testutilRequests(m, "manifest", outcomeMiss), "manifests fetched through the mirror")
	// The manifest started its layers' fetches: containerd's requests for
	// them may find them whole already.
	assert.Positive(t, testutilRequests(m, "blob", outcomeMiss)+testutilRequests(m, "blob", outcomeHit), "blobs served by the mirror")
	_, err = store.Stat(img.Digest)
	require.NoError(t, err, "the manifest is in the cache")

	reg.Stop()
	pull("second")
	assert.Equal(t, served, reg.BytesServed(), "nothing from the upstream")
	assert.Equal(t, 1.0, testutilRequests(m, "manifest", outcomeFallback), "the tag from its last known manifest")
	assert.Positive(t, testutilRequests(m, "blob", outcomeHit))

	// The agent down, the registry up: containerd falls back to the server.
	require.NoError(t, reg.Start(ctx))
	srv.Close()
	pull("third, the mirror down")
	assert.Greater(t, reg.BytesServed(), served, "from the upstream")
}

// The mirror's upstream in the agent.
var _ Upstream = (*oci.Source)(nil)

func testutilRequests(m *Mirror, kind, outcome string) float64 {
	return toFloat(m.m.requests.WithLabelValues(kind, outcome))
}
