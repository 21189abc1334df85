package mirror

import (
	"net/http"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

// upstreamCalls counts a fake upstream's calls by kind.
type upstreamCalls struct{ size, start, opens int32 }

func (u *fakeUpstream) calls() upstreamCalls {
	return upstreamCalls{u.sizeCalls.Load(), u.startCalls.Load(), u.opens.Load()}
}

// A small blob the cache lacks costs one request to the registry, whose
// answer both confirms the client's access and is the blob, whether or not
// a manifest gave its size; a long one costs that request or, its size
// known, a HEAD, then its fetch.
func TestSmallBlobInOneRequest(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(11, "docker.io", "library/app", "v1", 1000, 4*testChunk+10)
	other := up.addImage(12, "docker.io", "library/other", "v1", 3*testChunk)
	tm := newTestMirror(t, up, WithLayerPrefetch(false))
	get := func(repo string, b []byte) {
		t.Helper()
		resp, body, err := tm.do(t, http.MethodGet, "/v2/library/"+repo+"/blobs/"+digest.FromBytes(b).String())
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, b, body)
	}
	cached := func(b []byte) bool {
		_, err := tm.store.Stat(digest.FromBytes(b))
		return err == nil
	}
	for _, c := range []struct {
		what   string
		repo   string
		blob   []byte
		cached bool          // wait for the cache to hold the blob: it is written after the response
		want   upstreamCalls // more calls than before
	}{
		{"a config, its size unknown", "app", img.config, false, upstreamCalls{start: 1}},
		{"the config again: public, from the cache", "app", img.config, true, upstreamCalls{}},
		{"a long layer, its size unknown", "app", img.layers[1], false, upstreamCalls{start: 1, opens: 1}},
	} {
		if c.cached {
			require.Eventually(t, func() bool { return cached(c.blob) }, 10*time.Second, 10*time.Millisecond, "%s: the blob is kept in the cache", c.what)
		}
		before := up.calls()
		get(c.repo, c.blob)
		after := up.calls()
		assert.Equal(t, c.want, upstreamCalls{after.size - before.size, after.start - before.start, after.opens - before.opens}, c.what)
	}
	for _, repo := range []string{"app", "other"} {
		resp, _, err := tm.do(t, http.MethodGet, "/v2/library/"+repo+"/manifests/v1")
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	for _, c := range []struct {
		what string
		repo string
		blob []byte
		want upstreamCalls
	}{
		{"a small layer named by a manifest", "app", img.layers[0], upstreamCalls{start: 1}},
		{"a long layer named by a manifest", "other", other.layers[0], upstreamCalls{size: 1, opens: 1}},
	} {
		before := up.calls()
		get(c.repo, c.blob)
		after := up.calls()
		assert.Equal(t, c.want, upstreamCalls{after.size - before.size, after.start - before.start, after.opens - before.opens}, c.what)
	}
	require.Eventually(t, func() bool { return cached(img.layers[0]) }, 10*time.Second, 10*time.Millisecond, "the small layer is kept in the cache")
}

// The request that brings a small blob asks with the client's own
// credentials: a client the registry refuses gets nothing, before or
// after another client brought the blob into the cache.
func TestSmallBlobOnlyToClientsTheRegistryConfirms(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	up.password = "s3cret"
	img := up.addImage(13, "docker.io", "team/app", "v1", 1000)
	tm := newTestMirror(t, up, WithLayerPrefetch(false))
	layer := "/v2/team/app/blobs/" + digest.FromBytes(img.layers[0]).String()
	d := digest.FromBytes(img.layers[0])

	for _, round := range []string{"before", "after"} {
		resp, body, err := tm.do(t, http.MethodGet, layer)
		require.NoError(t, err)
		assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "%s: no credentials", round)
		assert.NotContains(t, string(body), string(img.layers[0][:64]))
		resp, _, err = tm.do(t, http.MethodGet, layer, basic("ci", "wrong")...)
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, resp.StatusCode, "%s: wrong credentials", round)
		if round == "before" {
			_, err := tm.store.Stat(d)
			require.ErrorIs(t, err, content.ErrNotFound, "nothing kept for refused clients")
			resp, body, err := tm.do(t, http.MethodGet, layer, basic("ci", "s3cret")...)
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			require.Equal(t, img.layers[0], body)
			require.Eventually(t, func() bool { _, err := tm.store.Stat(d); return err == nil }, 10*time.Second, 10*time.Millisecond)
		}
	}
}

// A small blob whose bytes do not match its digest is not sent, nor kept:
// the client is told to go to the registry at once (503).
func TestSmallBlobLyingUpstream(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(14, "docker.io", "library/app", "v1", 1000)
	d := digest.FromBytes(img.layers[0])
	up.lies[d] = randomBytes(77, 1000)
	tm := newTestMirror(t, up, WithLayerPrefetch(false))
	for range 2 {
		resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d.String())
		require.NoError(t, err)
		assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
		assert.Equal(t, "UNAVAILABLE", errorCode(t, body))
	}
	_, err := tm.store.Stat(d)
	assert.ErrorIs(t, err, content.ErrNotFound)
}
