package mirror

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/cache"
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
	m, err := New(store, &httpUpstream{client: &http.Client{Timeout: 30 * time.Second}}, WithRegistries(reg.Addr), WithStateDir(t.TempDir()))
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
	for _, l := range []string{"manifest", "blob"} {
		assert.Positive(t, testutilRequests(m, l, outcomeMiss), "%ss fetched through the mirror", l)
	}
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

func testutilRequests(m *Mirror, kind, outcome string) float64 {
	return toFloat(m.m.requests.WithLabelValues(kind, outcome))
}

// httpUpstream is a plain-HTTP, anonymous distribution API client: the
// least an Upstream needs, for a loopback test registry.
type httpUpstream struct{ client *http.Client }

var manifestAccept = strings.Join([]string{
	"application/vnd.oci.image.index.v1+json",
	"application/vnd.oci.image.manifest.v1+json",
	"application/vnd.docker.distribution.manifest.list.v2+json",
	"application/vnd.docker.distribution.manifest.v2+json",
}, ", ")

func (u *httpUpstream) get(ctx context.Context, method, url string, header ...string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, nil)
	if err != nil {
		return nil, err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := u.client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode >= 300 {
		resp.Body.Close()
		err := fmt.Errorf("%s %s: %s", method, url, resp.Status)
		if resp.StatusCode == http.StatusNotFound {
			return nil, cache.Permanent(fmt.Errorf("%w: %w", cache.ErrNotFound, err))
		}
		return nil, err
	}
	return resp, nil
}

func (u *httpUpstream) Manifest(ctx context.Context, registry, repository, reference string) (string, []byte, digest.Digest, error) {
	resp, err := u.get(ctx, http.MethodGet, "http://"+registry+"/v2/"+repository+"/manifests/"+reference, "Accept", manifestAccept)
	if err != nil {
		return "", nil, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxManifest+1))
	if err != nil {
		return "", nil, "", err
	}
	return resp.Header.Get("Content-Type"), body, digest.Digest(resp.Header.Get("Docker-Content-Digest")), nil
}

func (u *httpUpstream) BlobSize(ctx context.Context, registry, repository string, d digest.Digest) (int64, error) {
	resp, err := u.get(ctx, http.MethodHead, "http://"+registry+"/v2/"+repository+"/blobs/"+d.String())
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return strconv.ParseInt(resp.Header.Get("Content-Length"), 10, 64)
}

func (u *httpUpstream) BlobOpener(registry, repository string, desc cache.Descriptor) cache.RangeOpener {
	return openerFunc(func(ctx context.Context, off int64) (io.ReadCloser, error) {
		resp, err := u.get(ctx, http.MethodGet, "http://"+registry+"/v2/"+repository+"/blobs/"+desc.Digest.String(),
			"Range", fmt.Sprintf("bytes=%d-", off))
		if err != nil {
			return nil, err
		}
		if off > 0 && resp.StatusCode != http.StatusPartialContent {
			resp.Body.Close()
			return nil, fmt.Errorf("range request answered with %s", resp.Status)
		}
		return resp.Body, nil
	})
}
