package adversary

// Attack 3b and 3c, the agent's registry credentials for anyone: the mirror
// fetched every repository a client named with the agent's Docker config,
// so a pod without imagePullSecrets pulled private images through it; it
// served what it had cached to any client that named a digest; and it took
// a registry's 401 or 403 for an outage and served the tag's cached
// manifest, so access revoked at the registry kept working.

import (
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/mirror"
	"github.com/weightd/weightd/pkg/source/oci"
)

// privateRegistry is a real docker-registry that gives nothing without a
// token, its token server's user (a tenant's pull secret, and the agent's
// Docker config as operators deploy it), one pushed image, and the node's
// mirror in front of it.
type privateRegistry struct {
	reg    *services.Registry
	user   string
	pass   string // the credentials as first given, before any Revoke
	image  *services.PushedImage
	layer  digest.Digest
	store  *cache.Store
	mirror *httptest.Server
}

const privateRepo = "team-a/app"

func newPrivateRegistry(t *testing.T) *privateRegistry {
	t.Helper()
	reg := services.NewRegistryT(t, services.RegistryConfig{TokenAuth: true})
	img, err := services.PushRandomImage(t.Context(), reg.Addr, privateRepo, "v1", 2, 64<<10,
		authn.FromConfig(authn.AuthConfig{Username: reg.Username, Password: reg.Password}))
	require.NoError(t, err)
	layers, err := img.Image.Layers()
	require.NoError(t, err)
	ld, err := layers[0].Digest()
	require.NoError(t, err)

	dockerConfig := filepath.Join(t.TempDir(), "config.json")
	auth := base64.StdEncoding.EncodeToString([]byte(reg.Username + ":" + reg.Password))
	require.NoError(t, os.WriteFile(dockerConfig, fmt.Appendf(nil, `{"auths":{%q:{"auth":%q}}}`, reg.Addr, auth), 0o600))
	store, err := cache.Open(t.TempDir(), cache.WithRetries(2, time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	m, err := mirror.New(store, oci.New(oci.WithDockerConfig(dockerConfig)),
		mirror.WithRegistries(reg.Addr), mirror.WithManifestTimeout(5*time.Second))
	require.NoError(t, err)
	srv := httptest.NewServer(m)
	t.Cleanup(func() { srv.Close(); m.Close() })
	return &privateRegistry{reg: reg, user: reg.Username, pass: reg.Password, image: img, layer: digest.Digest(ld.String()), store: store, mirror: srv}
}

// pull asks the mirror for what, as containerd asks it (the ns parameter),
// with a pull secret's credentials when user is not empty; it returns the
// status, the WWW-Authenticate header and the body.
func (p *privateRegistry) pull(t *testing.T, what, user, pass string) (int, string, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, p.mirror.URL+"/v2/"+privateRepo+"/"+what+"?ns="+p.reg.Addr, nil)
	require.NoError(t, err)
	if user != "" {
		req.SetBasicAuth(user, pass)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, resp.Header.Get("WWW-Authenticate"), body
}

func (p *privateRegistry) paths() (tag, manifest, layer string) {
	return "manifests/v1", "manifests/" + p.image.Digest.String(), "blobs/" + p.layer.String()
}

func TestMirrorPrivateImageWithoutSecret(t *testing.T) {
	t.Parallel()
	p := newPrivateRegistry(t)
	tag, manifest, layer := p.paths()

	// A pod of team a, with its pull secret, pulls the image: it is cached.
	for _, what := range []string{tag, manifest, layer} {
		code, _, body := p.pull(t, what, p.user, p.pass)
		require.Equal(t, http.StatusOK, code, "%s with the pull secret: %s", what, body)
	}

	// A pod without imagePullSecrets asks for it: the tag, then the manifest
	// and a layer by the digests it learned (node.status.images names them).
	for _, what := range []string{tag, manifest, layer} {
		code, challenge, body := p.pull(t, what, "", "")
		require.NotEqual(t, http.StatusOK, code, "%s pulled through the mirror without a pull secret: %.200s", what, body)
		require.Equal(t, http.StatusUnauthorized, code, "%s: %s", what, body)
		require.Contains(t, challenge, "Basic ", "%s: the mirror asks for the client's own credentials", what)
	}
	// Credentials the registry refuses get its refusal, not the agent's.
	for _, what := range []string{tag, manifest, layer} {
		code, _, body := p.pull(t, what, p.user, "not-the-password")
		require.Equal(t, http.StatusForbidden, code, "%s with a wrong password: %s", what, body)
	}
}

func TestMirrorRevokedAccessServedFromCache(t *testing.T) {
	t.Parallel()
	p := newPrivateRegistry(t)
	tag, manifest, layer := p.paths()
	for _, what := range []string{tag, manifest, layer} {
		code, _, body := p.pull(t, what, p.user, p.pass)
		require.Equal(t, http.StatusOK, code, "%s: %s", what, body)
	}

	// The registry withdraws the pull secret's access (and every token it
	// issued for it).
	require.NoError(t, p.reg.Revoke(t.Context()))
	for _, what := range []string{tag, manifest, layer} {
		code, _, body := p.pull(t, what, p.user, p.pass)
		require.NotEqual(t, http.StatusOK, code, "%s still served from the cache after the registry revoked access: %.200s", what, body)
		require.Equal(t, http.StatusForbidden, code, "%s: the registry's refusal is passed on: %s", what, body)
	}

	// While the registry is down, the cached private image goes to no one.
	p.reg.Stop()
	for _, what := range []string{tag, manifest, layer} {
		for _, user := range []string{"", p.user} {
			code, _, body := p.pull(t, what, user, p.pass)
			require.NotEqual(t, http.StatusOK, code, "%s (user %q) served from the cache with the registry down: %.200s", what, user, body)
		}
	}
}

// TestMirrorPullSecretThroughCRI: containerd 2.4's CRI, given a pull
// secret as the kubelet gives it (no server address), answers the mirror's
// Basic challenge with it, so a pod with imagePullSecrets pulls a private
// image through the mirror while the agent uses no credentials of its own;
// without the secret the pull fails at the mirror and at the registry.
func TestMirrorPullSecretThroughCRI(t *testing.T) {
	t.Parallel()
	bins := services.RequireContainerd2(t)
	p := newPrivateRegistry(t)
	ctd := services.NewContainerdT(t, services.ContainerdConfig{Binaries: bins})
	require.NoError(t, mirror.ConfigureHosts(ctd.HostsDir, p.mirror.URL, []string{p.reg.Addr}, mirror.ServerURL(p.reg.Addr, "http://"+p.reg.Addr)))

	_, err := ctd.PullImageCRI(t.Context(), p.image.Ref)
	require.Error(t, err, "no pull secret")
	_, err = p.store.Stat(p.image.Digest)
	require.ErrorIs(t, err, content.ErrNotFound, "the mirror fetched nothing for a client without credentials")

	_, err = ctd.PullImageCRIAs(t.Context(), p.image.Ref, p.user, p.pass)
	require.NoError(t, err, "containerd's log ends:\n%s", ctd.LogTail())
	_, err = p.store.Stat(p.image.Digest)
	require.NoError(t, err, "the mirror fetched the manifest with the client's own credentials")
}
