package services_test

import (
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
)

func TestRegistryPushPullStopStart(t *testing.T) {
	t.Parallel()
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	ctx := t.Context()

	img, err := services.PushRandomImage(ctx, reg.Addr, "test/random", "v1", 2, 1<<20, nil)
	require.NoError(t, err)
	assert.Greater(t, img.Size, int64(2<<20))
	assert.True(t, strings.HasPrefix(img.Ref, reg.Addr+"/test/random:v1"), img.Ref)

	ref, err := name.ParseReference(img.Ref, name.Insecure)
	require.NoError(t, err)
	before := reg.BytesServed()
	desc, err := remote.Get(ref, remote.WithContext(ctx))
	require.NoError(t, err)
	assert.Equal(t, img.Digest.String(), desc.Digest.String())
	pulled, err := desc.Image()
	require.NoError(t, err)
	layers, err := pulled.Layers()
	require.NoError(t, err)
	require.Len(t, layers, 2)
	rc, err := layers[1].Compressed()
	require.NoError(t, err)
	n, err := ioCount(rc)
	require.NoError(t, err)
	assert.Greater(t, n, int64(1<<20))
	assert.GreaterOrEqual(t, reg.BytesServed()-before, n, "the proxy counts what it serves")

	reg.Stop()
	_, err = remote.Get(ref, remote.WithContext(ctx), remote.WithRetryBackoff(remote.Backoff{Steps: 1}))
	require.Error(t, err, "a stopped registry does not answer")

	require.NoError(t, reg.Start(ctx))
	desc, err = remote.Get(ref, remote.WithContext(ctx))
	require.NoError(t, err, "the same storage behind the same address after Start")
	assert.Equal(t, img.Digest.String(), desc.Digest.String())
}

func TestRegistryTokenAuth(t *testing.T) {
	t.Parallel()
	reg := services.NewRegistryT(t, services.RegistryConfig{TokenAuth: true})
	ctx := t.Context()
	require.NotEmpty(t, reg.Username)
	require.NotEmpty(t, reg.Password)
	creds := &authn.Basic{Username: reg.Username, Password: reg.Password}

	img, err := services.PushRandomImage(ctx, reg.Addr, "private/img", "latest", 1, 64<<10, creds)
	require.NoError(t, err)

	ref, err := name.ParseReference(img.Ref, name.Insecure)
	require.NoError(t, err)
	desc, err := remote.Get(ref, remote.WithContext(ctx), remote.WithAuth(creds))
	require.NoError(t, err)
	assert.Equal(t, img.Digest.String(), desc.Digest.String())

	noRetry := remote.WithRetryBackoff(remote.Backoff{Steps: 1})
	for _, tc := range []struct {
		name string
		auth authn.Authenticator
	}{
		{"anonymous", authn.Anonymous},
		{"wrong password", &authn.Basic{Username: reg.Username, Password: "wrong"}},
	} {
		_, err := remote.Get(ref, remote.WithContext(ctx), remote.WithAuth(tc.auth), noRetry)
		require.Error(t, err, tc.name)
		var terr *transport.Error
		require.True(t, errors.As(err, &terr), "%s: %v", tc.name, err)
		assert.Equal(t, http.StatusUnauthorized, terr.StatusCode, tc.name)
	}
	_, err = services.PushRandomImage(ctx, reg.Addr, "private/img", "anon", 1, 1024, nil)
	require.Error(t, err, "anonymous push is refused")

	// containerd's resolver (OAuth2 POST first) gets tokens too.
	if services.ContainerdAvailable() == nil {
		ctd := services.NewContainerdT(t, services.ContainerdConfig{})
		_, err := ctd.Ctr(ctx, "images", "pull", "--plain-http", img.Ref)
		require.Error(t, err, "anonymous pull is refused")
		_, err = ctd.Ctr(ctx, "images", "pull", "--plain-http", "--user", reg.Username+":"+reg.Password, img.Ref)
		require.NoError(t, err)
	}
}

func TestContainerdPullStopStart(t *testing.T) {
	t.Parallel()
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	ctd := services.NewContainerdT(t, services.ContainerdConfig{})
	ctx := t.Context()
	assert.Equal(t, "k8s.io", ctd.Namespace)
	assert.FileExists(t, ctd.Address)

	img, err := services.PushRandomImage(ctx, reg.Addr, "test/pull", "v1", 2, 512<<10, nil)
	require.NoError(t, err)
	out, err := ctd.Ctr(ctx, "images", "pull", "--plain-http", img.Ref)
	require.NoError(t, err)
	t.Logf("%s", out)
	out, err = ctd.Ctr(ctx, "images", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, string(out), img.Ref)
	out, err = ctd.Ctr(ctx, "images", "check")
	require.NoError(t, err)
	assert.Contains(t, string(out), "complete")
	out, err = ctd.Ctr(ctx, "snapshots", "--snapshotter", "overlayfs", "ls")
	require.NoError(t, err)
	assert.GreaterOrEqual(t, strings.Count(string(out), "Committed"), 2, "both layers unpacked:\n%s", out)

	ctd.Stop()
	_, err = os.Stat(ctd.Address)
	require.True(t, os.IsNotExist(err), "a stopped daemon removes its socket: %v", err)
	require.Error(t, err, "a stopped daemon does not answer")
	require.NoError(t, ctd.Start(ctx))
	out, err = ctd.Ctr(ctx, "images", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, string(out), img.Ref, "the same root after Start")
}

func TestContainerdLongDir(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), strings.Repeat("a-long-directory-name-", 5))
	ctd := services.NewContainerdT(t, services.ContainerdConfig{Dir: dir})
	assert.LessOrEqual(t, len(ctd.Address), 100)
	_, err := ctd.Ctr(t.Context(), "version")
	require.NoError(t, err)
	require.NoError(t, ctd.Close())
	_, err = os.Stat(ctd.Address)
	assert.True(t, os.IsNotExist(err), "the short socket directory is removed on Close")
}

func ioCount(rc interface {
	Read([]byte) (int, error)
	Close() error
}) (int64, error) {
	defer rc.Close()
	var n int64
	buf := make([]byte, 64<<10)
	for {
		m, err := rc.Read(buf)
		n += int64(m)
		if err != nil {
			if err.Error() == "EOF" {
				return n, nil
			}
			return n, err
		}
	}
}
