package mirror

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

const hex64 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

func TestPing(t *testing.T) {
	t.Parallel()
	tm := newTestMirror(t, newFakeUpstream())
	resp, body, err := tm.do(t, http.MethodGet, "/v2/")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "{}", string(body))
	assert.Equal(t, "registry/2.0", resp.Header.Get("Docker-Distribution-API-Version"))
}

func TestManifestByTag(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 1000)
	stateDir := t.TempDir()
	tm := newTestMirror(t, up, WithStateDir(stateDir))
	path := "/v2/library/app/manifests/v1?ns=docker.io"

	// From the upstream.
	resp, body, err := tm.do(t, http.MethodGet, path)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Equal(t, img.manifest, body)
	assert.Equal(t, mediaTypeOCIManifest, resp.Header.Get("Content-Type"))
	assert.Equal(t, img.digest.String(), resp.Header.Get("Docker-Content-Digest"))
	assert.Equal(t, `"`+img.digest.String()+`"`, resp.Header.Get("ETag"))
	assert.Equal(t, strconv.Itoa(len(img.manifest)), resp.Header.Get("Content-Length"))
	assert.Equal(t, 1.0, tm.requests("manifest", outcomeMiss))
	_, err = tm.store.Stat(img.digest)
	require.NoError(t, err, "the manifest is in the cache")

	// The upstream down: from the cache, by the remembered tag.
	up.setDown(true)
	resp, body, err = tm.do(t, http.MethodGet, path)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Equal(t, img.manifest, body)
	assert.Equal(t, img.digest.String(), resp.Header.Get("Docker-Content-Digest"))
	assert.Equal(t, mediaTypeOCIManifest, resp.Header.Get("Content-Type"))
	assert.Equal(t, 1.0, tm.requests("manifest", outcomeFallback))

	// A restarted mirror remembers the tag from its state directory.
	tm2 := newTestMirrorOn(t, tm.store, up, WithStateDir(stateDir))
	resp, body, err = tm2.do(t, http.MethodGet, "/v2/library/app/manifests/v1") // the only registry: no ns needed
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Equal(t, img.manifest, body)

	// A tag never seen, the upstream down: unavailable, not unknown.
	resp, body, err = tm.do(t, http.MethodGet, "/v2/library/app/manifests/v2?ns=docker.io")
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Equal(t, "UNAVAILABLE", errorCode(t, body))

	// The upstream up, the tag unknown there: 404.
	up.setDown(false)
	resp, body, err = tm.do(t, http.MethodGet, "/v2/library/app/manifests/v2?ns=docker.io")
	require.NoError(t, err)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	assert.Equal(t, "MANIFEST_UNKNOWN", errorCode(t, body))
}

func TestManifestTagMoves(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	up.addImage(1, "docker.io", "library/app", "v1", 100)
	tm := newTestMirror(t, up)
	_, _, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
	require.NoError(t, err)
	img2 := up.addImage(2, "docker.io", "library/app", "v1", 200)
	_, body, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
	require.NoError(t, err)
	assert.Equal(t, img2.manifest, body)
	up.setDown(true)
	resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, img2.manifest, body, "the fallback is the tag's latest manifest")
}

func TestManifestByDigest(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 100)
	tm := newTestMirror(t, up)
	path := "/v2/library/app/manifests/" + img.digest.String() + "?ns=docker.io"

	resp, body, err := tm.do(t, http.MethodGet, path)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Equal(t, img.manifest, body)
	assert.Equal(t, 1.0, tm.requests("manifest", outcomeMiss))

	up.setDown(true)
	calls := up.manifestCalls.Load()
	for _, method := range []string{http.MethodGet, http.MethodHead} {
		resp, body, err = tm.do(t, method, path)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
		assert.Equal(t, mediaTypeOCIManifest, resp.Header.Get("Content-Type"))
		assert.Equal(t, img.digest.String(), resp.Header.Get("Docker-Content-Digest"))
		assert.Equal(t, strconv.Itoa(len(img.manifest)), resp.Header.Get("Content-Length"))
		if method == http.MethodGet {
			assert.Equal(t, img.manifest, body)
		} else {
			assert.Empty(t, body)
		}
	}
	assert.Equal(t, calls, up.manifestCalls.Load(), "served from the cache")
	assert.Equal(t, 2.0, tm.requests("manifest", outcomeHit))

	// Unknown digest, the upstream up: 404.
	up.setDown(false)
	resp, body, err = tm.do(t, http.MethodHead, "/v2/library/app/manifests/sha256:"+hex64)
	require.NoError(t, err)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	assert.Empty(t, body)
}

func TestManifestHeadByTag(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 100)
	tm := newTestMirror(t, up)
	resp, body, err := tm.do(t, http.MethodHead, "/v2/library/app/manifests/v1")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Empty(t, body)
	assert.Equal(t, img.digest.String(), resp.Header.Get("Docker-Content-Digest"))
	assert.Equal(t, strconv.Itoa(len(img.manifest)), resp.Header.Get("Content-Length"))
}

func TestManifestLyingUpstream(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 100)
	// The registry answers for the digest with other bytes.
	up.mu.Lock()
	up.manifests["docker.io/library/app@"+img.digest.String()] = fakeManifest{mediaType: mediaTypeOCIManifest, body: []byte(`{"schemaVersion":2}`)}
	up.mu.Unlock()
	tm := newTestMirror(t, up)
	resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/"+img.digest.String())
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Equal(t, "UNAVAILABLE", errorCode(t, body))
	_, err = tm.store.Stat(img.digest)
	assert.ErrorIs(t, err, content.ErrNotFound)
	_, err = tm.store.Stat(digest.FromBytes([]byte(`{"schemaVersion":2}`)))
	assert.ErrorIs(t, err, content.ErrNotFound, "nothing stored")
}

func TestBlobFromCache(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	tm := newTestMirror(t, up)
	data := randomBytes(7, 300_000)
	d := digest.FromBytes(data)
	_, err := tm.store.Fetch(t.Context(), content.Descriptor{Digest: d, Size: int64(len(data))}, cache.Bytes(data), nil)
	require.NoError(t, err)
	path := "/v2/library/app/blobs/" + d.String() + "?ns=docker.io"
	// The registry confirms once that it gives the blob to anyone; an
	// unconfirmed blob is not served from the cache.
	resp, _, err := tm.do(t, http.MethodHead, path)
	require.NoError(t, err)
	require.Equal(t, http.StatusNotFound, resp.StatusCode, "the registry does not have it")
	up.mu.Lock()
	up.blobs[d] = data
	up.mu.Unlock()
	resp, _, err = tm.do(t, http.MethodHead, path)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, int32(2), up.sizeCalls.Load())

	tests := []struct {
		name, method, rng string
		code              int
		want              []byte
		contentRange      string
	}{
		{name: "full", method: http.MethodGet, code: 200, want: data},
		{name: "head", method: http.MethodHead, code: 200, want: []byte{}},
		{name: "range", method: http.MethodGet, rng: "bytes=10-99", code: 206, want: data[10:100], contentRange: "bytes 10-99/300000"},
		{name: "open range", method: http.MethodGet, rng: "bytes=299990-", code: 206, want: data[299990:], contentRange: "bytes 299990-299999/300000"},
		{name: "suffix", method: http.MethodGet, rng: "bytes=-5", code: 206, want: data[len(data)-5:], contentRange: "bytes 299995-299999/300000"},
		{name: "past the end", method: http.MethodGet, rng: "bytes=300000-", code: 416},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var hdr []string
			if tt.rng != "" {
				hdr = []string{"Range", tt.rng}
			}
			resp, body, err := tm.do(t, tt.method, path, hdr...)
			require.NoError(t, err)
			require.Equal(t, tt.code, resp.StatusCode)
			if tt.code == 416 {
				return
			}
			assert.Equal(t, tt.want, body)
			assert.Equal(t, d.String(), resp.Header.Get("Docker-Content-Digest"))
			assert.Equal(t, `"`+d.String()+`"`, resp.Header.Get("ETag"))
			assert.Equal(t, tt.contentRange, resp.Header.Get("Content-Range"))
			if tt.method == http.MethodHead {
				assert.Equal(t, strconv.Itoa(len(data)), resp.Header.Get("Content-Length"))
			}
		})
	}
	assert.Zero(t, up.opens.Load(), "nothing fetched upstream")
	assert.Equal(t, int32(2), up.sizeCalls.Load(), "nothing asked upstream once the blob is public")
}

func TestBlobMissing(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 200_000, 5000)
	tm := newTestMirror(t, up)

	// HEAD answers with the size (from the upstream) without fetching.
	d0 := digest.FromBytes(img.layers[0])
	resp, body, err := tm.do(t, http.MethodHead, "/v2/library/app/blobs/"+d0.String())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Empty(t, body)
	assert.Equal(t, "200000", resp.Header.Get("Content-Length"))
	assert.Zero(t, up.opens.Load())
	assert.Equal(t, int32(1), up.sizeCalls.Load())

	// A manifest does not make its layers public: each is asked about once
	// (a registry may hold a manifest naming blobs it does not give).
	_, _, err = tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
	require.NoError(t, err)
	d1 := digest.FromBytes(img.layers[1])
	resp, body, err = tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d1.String())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, img.layers[1], body)
	// Asked about once: whole (a small blob), or with a HEAD where the
	// manifest's prefetch of it is in the cache already.
	asked := func() int32 { return up.sizeCalls.Load() + up.startCalls.Load() }
	assert.Equal(t, int32(2), asked())
	// A small blob is sent before its commit completes.
	require.Eventually(t, func() bool { _, err := tm.store.Stat(d1); return err == nil }, 5*time.Second, 5*time.Millisecond,
		"the blob is in the cache")

	// A ranged GET of a missing blob.
	resp, body, err = tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d0.String(), "Range", "bytes=70000-70009")
	require.NoError(t, err)
	require.Equal(t, http.StatusPartialContent, resp.StatusCode)
	assert.Equal(t, img.layers[0][70000:70010], body)
	assert.Equal(t, "bytes 70000-70009/200000", resp.Header.Get("Content-Range"))
	assert.Equal(t, int32(2), asked(), "a blob the registry gave anonymously is public from then on")

	// Unknown blob: 404.
	resp, body, err = tm.do(t, http.MethodGet, "/v2/library/app/blobs/sha256:"+hex64)
	require.NoError(t, err)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	assert.Equal(t, "BLOB_UNKNOWN", errorCode(t, body))
	assert.Equal(t, 1.0, tm.requests("blob", outcomeNotFound))
}

// TestBlobStreamedWhileFetched checks that a client gets the first bytes of
// a missing blob before its fetch completes, and then all of it.
func TestBlobStreamedWhileFetched(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 10*testChunk+123)
	layer := img.layers[0]
	d := digest.FromBytes(layer)
	up.gate, up.gateAt = make(chan struct{}), 5*testChunk
	var wrapped atomic.Int32
	tm := newTestMirror(t, up, WithBlobSource(func(desc content.Descriptor, _ string, upstream content.RangeOpener) content.RangeOpener {
		wrapped.Add(1)
		return upstream
	}))

	resp, err := tm.srv.Client().Get(tm.srv.URL + "/v2/library/app/blobs/" + d.String())
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, strconv.Itoa(len(layer)), resp.Header.Get("Content-Length"))
	first := make([]byte, 4*testChunk)
	_, err = io.ReadFull(resp.Body, first)
	require.NoError(t, err)
	assert.Equal(t, layer[:len(first)], first)
	_, err = tm.store.Stat(d)
	require.ErrorIs(t, err, content.ErrNotFound, "the first bytes came before the fetch completed")

	close(up.gate)
	rest, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, layer, append(first, rest...))
	assert.Equal(t, int32(1), wrapped.Load(), "the blob source wraps the upstream")
	assert.Eventually(t, func() bool { return testutilBytes(tm, "fetch") == float64(len(layer)) }, 5*time.Second, 5*time.Millisecond)
}

func testutilBytes(tm *testMirror, source string) float64 {
	return toFloat(tm.m.bytes.WithLabelValues(source))
}

// TestBlobClientGoes checks that a client that goes mid-blob ends its
// request at once while the fetch completes into the cache for the next.
func TestBlobClientGoes(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 8*testChunk)
	layer := img.layers[0]
	d := digest.FromBytes(layer)
	up.gate, up.gateAt = make(chan struct{}), 3*testChunk
	tm := newTestMirror(t, up)

	ctx, cancel := context.WithCancel(t.Context())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, tm.srv.URL+"/v2/library/app/blobs/"+d.String(), nil)
	require.NoError(t, err)
	resp, err := tm.srv.Client().Do(req)
	require.NoError(t, err)
	_, err = io.ReadFull(resp.Body, make([]byte, testChunk))
	require.NoError(t, err)
	cancel()
	resp.Body.Close()
	require.Eventually(t, func() bool { return tm.active.Load() == 0 }, 5*time.Second, 5*time.Millisecond,
		"the request ends when its client goes")

	close(up.gate)
	require.Eventually(t, func() bool { _, err := tm.store.Stat(d); return err == nil }, 5*time.Second, 5*time.Millisecond,
		"the fetch completes without the client")
	opens := up.opens.Load()
	resp2, body, err := tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d.String())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp2.StatusCode)
	assert.Equal(t, layer, body)
	assert.Equal(t, opens, up.opens.Load(), "the second request is served from the cache")
	assert.Equal(t, 1.0, tm.requests("blob", outcomeHit))
}

// TestBlobLyingUpstream checks that bytes that do not match the digest never
// make a complete response, nor enter the cache.
func TestBlobLyingUpstream(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 4*testChunk+10, 1000)
	for i, l := range img.layers {
		lie := randomBytes(99+uint64(i), len(l))
		up.lies[digest.FromBytes(l)] = lie
	}
	tm := newTestMirror(t, up)
	_, _, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
	require.NoError(t, err)
	for _, l := range img.layers {
		d := digest.FromBytes(l)
		resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d.String())
		complete := err == nil && resp.StatusCode == http.StatusOK && len(body) == len(l)
		assert.False(t, complete, "a complete response of wrong bytes (status %d, %d bytes)", resp.StatusCode, len(body))
		if resp.StatusCode == http.StatusOK {
			assert.Error(t, err, "a short body")
		}
		_, err = tm.store.Stat(d)
		assert.ErrorIs(t, err, content.ErrNotFound, "nothing committed")
	}
}

func TestBlobUpstreamDown(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	up.setDown(true)
	tm := newTestMirror(t, up)
	resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/blobs/sha256:"+hex64)
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Equal(t, "UNAVAILABLE", errorCode(t, body))
	assert.Equal(t, 1.0, tm.requests("blob", outcomeError))
}

func TestRegistries(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	imgA := up.addImage(1, "docker.io", "library/app", "v1", 10)
	imgB := up.addImage(2, "example.com:5000", "library/app", "v1", 10)
	one := newTestMirror(t, up)
	two := newTestMirror(t, up, WithRegistries("example.com:5000"))
	tests := []struct {
		name string
		tm   *testMirror
		path string
		code int
		want []byte
	}{
		{"ns", one, "/v2/library/app/manifests/v1?ns=docker.io", 200, imgA.manifest},
		{"docker hub alias", one, "/v2/library/app/manifests/v1?ns=registry-1.docker.io", 200, imgA.manifest},
		{"default registry", one, "/v2/library/app/manifests/v1", 200, imgA.manifest},
		{"unknown registry", one, "/v2/library/app/manifests/v1?ns=quay.io", 404, nil},
		{"bad ns", one, "/v2/library/app/manifests/v1?ns=a/b", 404, nil},
		{"two ns", one, "/v2/library/app/manifests/v1?ns=docker.io&ns=docker.io", 404, nil},
		{"second registry", two, "/v2/library/app/manifests/v1?ns=example.com:5000", 200, imgB.manifest},
		{"no default of two", two, "/v2/library/app/manifests/v1", 404, nil},
		{"unknown blob registry", one, "/v2/library/app/blobs/sha256:" + hex64 + "?ns=quay.io", 404, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			resp, body, err := tt.tm.do(t, http.MethodGet, tt.path)
			require.NoError(t, err)
			require.Equal(t, tt.code, resp.StatusCode, "%s", body)
			if tt.code == 200 {
				assert.Equal(t, tt.want, body)
			} else {
				assert.Equal(t, "NAME_UNKNOWN", errorCode(t, body))
			}
		})
	}
}

func TestMalformedRequests(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	m, err := New(newNullStore(), up, WithRegistries("docker.io"))
	require.NoError(t, err)
	tests := []struct {
		method, path string
		code         int
		errCode      string
	}{
		{"GET", "/v2/Library/app/manifests/v1", 400, "NAME_INVALID"},
		{"GET", "/v2/library//app/manifests/v1", 400, "NAME_INVALID"},
		{"GET", "/v2/../etc/manifests/v1", 400, "NAME_INVALID"},
		{"GET", "/v2/%2e%2e/etc/manifests/v1", 400, "NAME_INVALID"},
		{"GET", "/v2/a%2Fb/manifests/v1", 400, "NAME_INVALID"},
		{"GET", "/v2/a-/manifests/v1", 400, "NAME_INVALID"},
		{"GET", "/v2/manifests/v1", 404, "UNSUPPORTED"},
		{"GET", "/v2/a/manifests/-v1", 400, "MANIFEST_INVALID"},
		{"GET", "/v2/a/manifests/", 400, "MANIFEST_INVALID"},
		{"GET", "/v2/a/manifests/sha256:abc", 400, "DIGEST_INVALID"},
		{"GET", "/v2/a/blobs/v1", 400, "DIGEST_INVALID"},
		{"GET", "/v2/a/blobs/sha256:" + hex64[:63] + "A", 400, "DIGEST_INVALID"},
		{"GET", "/v2/a/blobs/sha512:" + hex64 + hex64, 400, "DIGEST_INVALID"},
		{"GET", "/v2/a/blobs/uploads/", 404, "UNSUPPORTED"},
		{"GET", "/v2/a/tags/list", 404, "UNSUPPORTED"},
		{"GET", "/v2/_catalog", 404, "UNSUPPORTED"},
		{"GET", "/v1/a/manifests/v1", 404, "UNSUPPORTED"},
		{"POST", "/v2/a/blobs/uploads/", 405, "UNSUPPORTED"},
		{"PUT", "/v2/a/manifests/v1", 405, "UNSUPPORTED"},
		{"DELETE", "/v2/a/blobs/sha256:" + hex64, 405, "UNSUPPORTED"},
	}
	for _, tt := range tests {
		t.Run(tt.method+" "+tt.path, func(t *testing.T) {
			t.Parallel()
			rec := httptest.NewRecorder()
			m.ServeHTTP(rec, httptest.NewRequest(tt.method, tt.path, nil))
			assert.Equal(t, tt.code, rec.Code)
			assert.Equal(t, "application/json", rec.Header().Get("Content-Type"))
			assert.Equal(t, tt.errCode, errorCode(t, rec.Body.Bytes()))
		})
	}
	assert.Zero(t, up.manifestCalls.Load()+up.sizeCalls.Load()+up.opens.Load(), "nothing reached the upstream")
}

func TestNewRejects(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	for name, opt := range map[string]Option{
		"bad registry":     WithRegistries("not a host"),
		"nil blob source":  WithBlobSource(nil),
		"empty state dir":  WithStateDir(""),
		"zero timeout":     WithFetchTimeout(0),
		"negative timeout": WithManifestTimeout(-time.Second),
	} {
		_, err := New(newNullStore(), up, opt)
		assert.ErrorIs(t, err, content.ErrInvalid, name)
	}
	_, err := New(nil, up)
	assert.ErrorIs(t, err, content.ErrInvalid)
}

// TestBlobCoalesced checks that clients asking at once for a missing blob
// share one fetch and all get the right bytes.
func TestBlobCoalesced(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 6*testChunk+7)
	layer := img.layers[0]
	d := digest.FromBytes(layer)
	up.gate, up.gateAt = make(chan struct{}), 2*testChunk
	tm := newTestMirror(t, up)
	const clients = 4
	errs := make(chan error, clients)
	for range clients {
		go func() {
			resp, err := tm.srv.Client().Get(tm.srv.URL + "/v2/library/app/blobs/" + d.String())
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err == nil && string(body) != string(layer) {
				err = assert.AnError
			}
			errs <- err
		}()
	}
	require.Eventually(t, func() bool { return tm.requests("blob", outcomeMiss) == clients }, 5*time.Second, 5*time.Millisecond)
	close(up.gate)
	for range clients {
		require.NoError(t, <-errs)
	}
	assert.Equal(t, int32(1), up.opens.Load(), "one fetch")
}

// TestCloseEndsFetches checks that Close stops the fetches requests started
// and that the streaming request ends short.
func TestCloseEndsFetches(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 6*testChunk)
	d := digest.FromBytes(img.layers[0])
	up.gate, up.gateAt = make(chan struct{}), 2*testChunk
	defer close(up.gate)
	tm := newTestMirror(t, up)
	resp, err := tm.srv.Client().Get(tm.srv.URL + "/v2/library/app/blobs/" + d.String())
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.NoError(t, tm.Close())
	_, err = io.ReadAll(resp.Body)
	assert.Error(t, err, "a short body")
	_, err = tm.store.Stat(d)
	assert.ErrorIs(t, err, content.ErrNotFound)
	resp2, body, err := tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d.String())
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp2.StatusCode, "%s", body)
}

func TestLearnTagFromPrefetch(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(3, "docker.io", "library/app", "v1", 100)
	tm := newTestMirror(t, up)
	up.setDown(true)

	// Not in the cache yet: nothing to learn.
	require.ErrorIs(t, tm.Learn("docker.io", "library/app", "v1", img.digest, true), content.ErrNotFound)
	// A prefetch stored the manifest and tells the mirror what the tag named.
	_, err := tm.store.Fetch(t.Context(), content.Descriptor{Digest: img.digest, Size: int64(len(img.manifest))}, cache.Bytes(img.manifest), nil)
	require.NoError(t, err)
	require.NoError(t, tm.Learn("index.docker.io", "library/app", "v1", img.digest, true))
	require.NoError(t, tm.Learn("ghcr.io", "org/other", "v1", img.digest, true), "registries not mirrored are ignored")

	resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1?ns=docker.io")
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Equal(t, img.manifest, body)
	assert.Equal(t, mediaTypeOCIManifest, resp.Header.Get("Content-Type"))
}
