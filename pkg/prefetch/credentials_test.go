package prefetch_test

import (
	"net/url"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

func TestAgentCredentials(t *testing.T) {
	t.Parallel()
	a, err := prefetch.ParseAgentCredentials([]string{"Registry.Example.com:5000=team-a;team-b", "index.docker.io=*", "huggingface.co=ml"})
	require.NoError(t, err)
	for _, tt := range []struct {
		host, ns string
		want     bool
	}{
		{"registry.example.com:5000", "", true}, // the operator
		{"ghcr.io", "", true},
		{"registry.example.com:5000", "team-a", true},
		{"REGISTRY.example.com:5000", "team-b", true},
		{"registry.example.com:5000", "team-c", false},
		{"registry.example.com:5000", prefetch.UnknownNamespace, false}, // a mirror client
		{"registry.example.com", "team-a", false},                       // another port, another host
		{"docker.io", "anyone", true},
		{"registry-1.docker.io", prefetch.UnknownNamespace, true},
		{"huggingface.co", "ml", true},
		{"huggingface.co", "web", false},
		{"ghcr.io", "team-a", false},
	} {
		assert.Equal(t, tt.want, a.Allow(tt.host, tt.ns), "%s for %q", tt.host, tt.ns)
	}
	var none prefetch.AgentCredentials
	assert.True(t, none.Allow("ghcr.io", ""), "the zero value: the operator only")
	assert.False(t, none.Allow("ghcr.io", "team-a"))

	for _, bad := range []string{"ghcr.io", "=team-a", "ghcr.io=", "ghcr.io=Team_A", "ghcr.io=a;;b", "no host/x=a"} {
		_, err := prefetch.ParseAgentCredentials([]string{bad})
		require.ErrorIs(t, err, content.ErrInvalid, bad)
	}
}

// TestHFTokenPerNamespace: the token goes only on requests for the
// operator and the namespaces a rule names for the hub's host.
func TestHFTokenPerNamespace(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	hub.AddRepo("team-a/private", map[string]hubtest.Content{"config.json": hubtest.String(`{}`)}, hubtest.Private("secret"))
	u, err := url.Parse(hub.URL)
	require.NoError(t, err)
	creds, err := prefetch.ParseAgentCredentials([]string{u.Host + "=team-a"})
	require.NoError(t, err)
	src := hfSource(t, hub.URL, prefetch.WithHFToken("secret"), prefetch.WithHFAgentCredentials(creds))
	r, err := ref.Parse("hf://team-a/private@main")
	require.NoError(t, err)

	for ns, ok := range map[string]bool{"": true, "team-a": true, "team-b": false} {
		_, err := src.Resolve(prefetch.WithRequester(t.Context(), ns), r)
		if ok {
			require.NoError(t, err, "namespace %q", ns)
			continue
		}
		require.Error(t, err, "namespace %q", ns)
		assert.Contains(t, err.Error(), `the agent's hub token is not used for namespace "team-b"`)
	}
}

// TestSubmitForNamespace: jobs are shared by requests of one requester
// only, since another may not be allowed the agent's credentials.
func TestSubmitForNamespace(t *testing.T) {
	t.Parallel()
	q := prefetch.NewQueue(hfStore(t), prefetch.Sources{})
	const ref = "hf://org/model@main"
	op, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	a1, err := q.Submit(ref, prefetch.PriorityPod, prefetch.ForNamespace("team-a"))
	require.NoError(t, err)
	a2, err := q.Submit(ref, prefetch.PriorityPod, prefetch.ForNamespace("team-a"))
	require.NoError(t, err)
	b, err := q.Submit(ref, prefetch.PriorityPod, prefetch.ForNamespace("team-b"))
	require.NoError(t, err)
	again, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	assert.Same(t, a1, a2)
	assert.Same(t, op, again)
	assert.NotEqual(t, op.ID(), a1.ID())
	assert.NotEqual(t, a1.ID(), b.ID())
}
