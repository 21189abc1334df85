package hf_test

import (
	"net/url"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
)

// TestTokenPerNamespace: the token goes only on requests for the
// operator and the namespaces a rule names for the hub's host.
func TestTokenPerNamespace(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	hub.AddRepo("team-a/private", map[string]hubtest.Content{"config.json": hubtest.String(`{}`)}, hubtest.Private("secret"))
	u, err := url.Parse(hub.URL)
	require.NoError(t, err)
	creds, err := source.ParseAgentCredentials([]string{u.Host + "=team-a"})
	require.NoError(t, err)
	src := hfSource(t, hub.URL, hf.WithToken("secret"), hf.WithAgentCredentials(creds))
	r, err := ref.Parse("hf://team-a/private@main")
	require.NoError(t, err)

	for ns, ok := range map[string]bool{"": true, "team-a": true, "team-b": false} {
		_, err := src.Resolve(source.WithRequester(t.Context(), ns), r)
		if ok {
			require.NoError(t, err, "namespace %q", ns)
			continue
		}
		require.Error(t, err, "namespace %q", ns)
		assert.Contains(t, err.Error(), `the agent's hub token is not used for namespace "team-b"`)
	}
}
