package mirror

import (
	"encoding/base64"
	"net/http"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

func basic(user, pass string) []string {
	return []string{"Authorization", "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))}
}

// TestPrivateRegistry: the client's own credentials go upstream; without
// them the client is challenged; cached private content goes only to
// clients the registry confirms; nothing private while it is down.
func TestPrivateRegistry(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	up.password = "s3cret"
	img := up.addImage(5, "docker.io", "team/app", "v1", 1000)
	tm := newTestMirror(t, up)
	tag := "/v2/team/app/manifests/v1?ns=docker.io"
	byDigest := "/v2/team/app/manifests/" + img.digest.String() + "?ns=docker.io"
	layer := "/v2/team/app/blobs/" + digest.FromBytes(img.layers[0]).String() + "?ns=docker.io"

	resp, _, err := tm.do(t, http.MethodGet, tag)
	require.NoError(t, err)
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	assert.Equal(t, challenge, resp.Header.Get("WWW-Authenticate"))

	for _, p := range []string{tag, byDigest, layer} {
		resp, body, err := tm.do(t, http.MethodGet, p, basic("ci", "s3cret")...)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", p, body)
	}
	for _, p := range []string{byDigest, layer} {
		resp, _, err := tm.do(t, http.MethodGet, p)
		require.NoError(t, err)
		assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "cached %s without credentials", p)
		resp, _, err = tm.do(t, http.MethodGet, p, basic("ci", "wrong")...)
		require.NoError(t, err)
		assert.Equal(t, http.StatusForbidden, resp.StatusCode, "cached %s with wrong credentials", p)
	}
	assert.Positive(t, tm.requests("manifest", outcomeDenied))

	// Down: the tag's cached manifest is private, so no fallback for a
	// client the registry never confirmed.
	up.setDown(true)
	resp, _, err = tm.do(t, http.MethodGet, tag)
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	resp, _, err = tm.do(t, http.MethodGet, tag, basic("other", "guess")...)
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
}

// TestAgentCredentialsForMirrorClients: a registry whose rule names every
// namespace has the agent's credentials used for clients that send none.
func TestAgentCredentialsForMirrorClients(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	up.password = "s3cret"
	up.addImage(6, "docker.io", "team/app", "v1", 1000)
	creds, err := source.ParseAgentCredentials([]string{"docker.io=*"})
	require.NoError(t, err)
	tm := newTestMirror(t, up, WithAgentCredentials(creds))
	resp, body, err := tm.do(t, http.MethodGet, "/v2/team/app/manifests/v1?ns=docker.io")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)

	named, err := source.ParseAgentCredentials([]string{"docker.io=team"})
	require.NoError(t, err)
	tm = newTestMirror(t, up, WithAgentCredentials(named))
	resp, _, err = tm.do(t, http.MethodGet, "/v2/team/app/manifests/v1?ns=docker.io")
	require.NoError(t, err)
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "a rule naming a namespace is not for the mirror's clients")
}

// TestLearnPrivateTag: a tag a prefetch learned with credentials is not
// served while the registry is down; a public one is.
func TestLearnPrivateTag(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(7, "docker.io", "library/app", "v1", 100)
	tm := newTestMirror(t, up)
	up.setDown(true)
	_, err := tm.store.Fetch(t.Context(), content.Descriptor{Digest: img.digest, Size: int64(len(img.manifest))}, cache.Bytes(img.manifest), nil)
	require.NoError(t, err)
	require.NoError(t, tm.Learn("docker.io", "library/app", "v1", img.digest, false))
	resp, _, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1?ns=docker.io")
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.NoError(t, tm.Learn("docker.io", "library/app", "v1", img.digest, true))
	resp, _, err = tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1?ns=docker.io")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
}
