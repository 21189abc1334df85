package services_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
)

// TestContainerd2PullCRI runs the containerd 2.x that `make test-deps`
// builds (go run ./internal/services/cmd/containerd2): its version 3 config
// loads, and the CRI pulls an image through the hosts.toml of its
// config_path. Where it has not been built the test skips, and fails under
// CI=true.
func TestContainerd2PullCRI(t *testing.T) {
	t.Parallel()
	bins := services.RequireContainerd2(t)
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	ctd := services.NewContainerdT(t, services.ContainerdConfig{Binaries: bins})
	ctx := t.Context()

	out, err := ctd.Ctr(ctx, "version")
	require.NoError(t, err)
	assert.Contains(t, string(out), strings.TrimPrefix(services.Containerd2Version, "v"))

	img, err := services.PushRandomImage(ctx, reg.Addr, "test/cri", "v1", 2, 256<<10, nil)
	require.NoError(t, err)
	hosts := filepath.Join(ctd.HostsDir, reg.Addr, "hosts.toml")
	require.NoError(t, os.MkdirAll(filepath.Dir(hosts), 0o755))
	require.NoError(t, os.WriteFile(hosts, []byte(`server = "http://`+reg.Addr+`"`+"\n"), 0o644))

	before := reg.BytesServed()
	id, err := ctd.PullImageCRI(ctx, img.Ref)
	require.NoError(t, err, "containerd's log ends:\n%s", ctd.LogTail())
	assert.True(t, strings.HasPrefix(id, "sha256:"), id)
	assert.Greater(t, reg.BytesServed()-before, int64(512<<10), "both layers from the registry")
	out, err = ctd.Ctr(ctx, "images", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, string(out), img.Ref)
	out, err = ctd.Ctr(ctx, "content", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, string(out), img.Digest.String())
}
