package csi_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/prefetch"
)

func TestParseAttributes(t *testing.T) {
	t.Parallel()
	req, err := csi.ParseAttributes(map[string]string{
		csi.AttrModel: "hf://org/m", csi.AttrPriority: "background", csi.AttrFiles: "*.safetensors, sub/*.json",
		csi.AttrPodNamespace: "team-a", csi.AttrPodName: "p", csi.AttrEphemeral: "true",
	})
	require.NoError(t, err)
	assert.Equal(t, "hf://org/m@main", req.Ref.String())
	assert.Equal(t, prefetch.PriorityBackground, req.Priority)
	assert.Equal(t, "team-a", req.Namespace)
	assert.True(t, req.Wants("model-00001.safetensors"))
	assert.True(t, req.Wants("deep/dir/x.safetensors"), "a pattern without a slash matches the base name")
	assert.True(t, req.Wants("sub/config.json"))
	assert.False(t, req.Wants("config.json"), "a pattern with a slash matches the whole path")

	req, err = csi.ParseAttributes(map[string]string{csi.AttrModel: "hf://org/m"})
	require.NoError(t, err)
	assert.Equal(t, prefetch.PriorityPod, req.Priority, "pod priority by default")
	assert.True(t, req.Wants("anything"))
}

func TestAllowlist(t *testing.T) {
	t.Parallel()
	a, err := csi.ParseAllowlist("team-a=hf://org/;oci://ghcr.io/org/, *=hf://public/")
	require.NoError(t, err)
	assert.NoError(t, a.Check("team-a", "hf://org/m@main"))
	assert.NoError(t, a.Check("team-a", "oci://ghcr.io/org/m:v1"))
	assert.NoError(t, a.Check("team-b", "hf://public/m@main"), "* applies to every namespace")
	assert.ErrorIs(t, a.Check("team-b", "hf://org/m@main"), csi.ErrNotAllowed)

	var none csi.Allowlist
	assert.NoError(t, none.Check("any", "hf://x/y@main"), "no allowlist allows everything")
	for _, bad := range []string{"team-a", "=hf://", "Team_A=hf://", "a="} {
		_, err := csi.ParseAllowlist(bad)
		assert.Error(t, err, bad)
	}
}
