package mirror

import (
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
)

// TestContainerdPullThroughCorporateMirrorAgentDead follows a node whose
// pulls of a registry go through a corporate mirror with its own CA (a
// second registry behind TLS, started here, its CA named by a path relative
// to the hosts.toml as operators write it): once weightd has merged its
// mirror in front and the agent is dead (nothing listens at its address), a
// CRI pull by containerd 2.4.2 still succeeds through the corporate mirror,
// whose access log shows the manifest and blobs; the registry's own name
// resolves nowhere, so no other path could serve it. Restoring puts the
// node's file back byte for byte.
func TestContainerdPullThroughCorporateMirrorAgentDead(t *testing.T) {
	t.Parallel()
	bins := services.RequireContainerd2(t)
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	img, err := services.PushRandomImage(t.Context(), reg.Addr, "team/app", "v1", 2, 128<<10, nil)
	require.NoError(t, err)

	var mu sync.Mutex
	var accessLog []string
	upstream, err := url.Parse("http://" + reg.Addr)
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(upstream)
	corp := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		accessLog = append(accessLog, r.Method+" "+r.URL.Path)
		mu.Unlock()
		proxy.ServeHTTP(w, r)
	}))
	corp.StartTLS()
	t.Cleanup(corp.Close)

	const registry = "registry.invalid"
	ref := strings.Replace(img.Ref, reg.Addr, registry, 1)
	ctd := services.NewContainerdT(t, services.ContainerdConfig{Binaries: bins})
	dir := filepath.Join(ctd.HostsDir, registry)
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "corp-ca.pem"),
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: corp.Certificate().Raw}), 0o644))
	original := "# the corporate mirror, then the registry\nserver = \"https://" + registry + "\"\n\n" +
		"[host.\"" + corp.URL + "\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"corp-ca.pem\"\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hosts.toml"), []byte(original), 0o644))

	// The agent's address, dead: it listened once and is gone.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	agentURL := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())
	require.NoError(t, ConfigureHosts(ctd.HostsDir, agentURL, []string{registry}))
	merged, err := os.ReadFile(filepath.Join(dir, "hosts.toml"))
	require.NoError(t, err)
	require.True(t, strings.Index(string(merged), agentURL) < strings.Index(string(merged), corp.URL), "weightd's mirror first:\n%s", merged)

	_, err = ctd.PullImageCRI(t.Context(), ref)
	require.NoError(t, err, "CRI pull with the agent dead:\n%s\n%s", merged, ctd.LogTail())
	mu.Lock()
	got := strings.Join(accessLog, "\n")
	mu.Unlock()
	assert.Contains(t, got, "GET /v2/team/app/manifests/", "the manifest through the corporate mirror")
	m, err := img.Image.Manifest()
	require.NoError(t, err)
	for _, l := range m.Layers {
		assert.Contains(t, got, "GET /v2/team/app/blobs/"+l.Digest.String(), "each layer through the corporate mirror")
	}

	require.NoError(t, RestoreHosts(ctd.HostsDir, []string{registry}))
	restored, err := os.ReadFile(filepath.Join(dir, "hosts.toml"))
	require.NoError(t, err)
	assert.Equal(t, original, string(restored))
	assert.NoFileExists(t, filepath.Join(dir, "hosts.toml.weightd-backup"))
}
