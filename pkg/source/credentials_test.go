package source_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

func TestAgentCredentials(t *testing.T) {
	t.Parallel()
	a, err := source.ParseAgentCredentials([]string{"Registry.Example.com:5000=team-a;team-b", "index.docker.io=*", "huggingface.co=ml"})
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
		{"registry.example.com:5000", source.UnknownNamespace, false}, // a mirror client
		{"registry.example.com", "team-a", false},                     // another port, another host
		{"docker.io", "anyone", true},
		{"registry-1.docker.io", source.UnknownNamespace, true},
		{"huggingface.co", "ml", true},
		{"huggingface.co", "web", false},
		{"ghcr.io", "team-a", false},
	} {
		assert.Equal(t, tt.want, a.Allow(tt.host, tt.ns), "%s for %q", tt.host, tt.ns)
	}
	var none source.AgentCredentials
	assert.True(t, none.Allow("ghcr.io", ""), "the zero value: the operator only")
	assert.False(t, none.Allow("ghcr.io", "team-a"))

	for _, bad := range []string{"ghcr.io", "=team-a", "ghcr.io=", "ghcr.io=Team_A", "ghcr.io=a;;b", "no host/x=a"} {
		_, err := source.ParseAgentCredentials([]string{bad})
		require.ErrorIs(t, err, content.ErrInvalid, bad)
	}
}
