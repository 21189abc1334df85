package oci_test

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/oci"
)

// TestRealRegistry resolves and fetches an image and ModelPack models
// (as v0.0.6 and v0.0.7 of the spec lay them out) from a real
// docker-registry (distribution), anonymous and behind bearer tokens. It skips where docker-registry is missing, except under CI=true.
func TestRealRegistry(t *testing.T) {
	t.Parallel()
	for _, tokenAuth := range []bool{false, true} {
		name := "anonymous"
		if tokenAuth {
			name = "token"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			reg := services.NewRegistryT(t, services.RegistryConfig{TokenAuth: tokenAuth})
			var (
				push authn.Authenticator
				opts []oci.Option
			)
			rg := &ociRegistry{host: reg.Addr}
			if tokenAuth {
				push = &authn.Basic{Username: reg.Username, Password: reg.Password}
				rg.auth = []authn.Authenticator{push}
				opts = append(opts, oci.WithPullSecret(dockerConfigJSON(reg.Addr, reg.Username, reg.Password)))
			}
			img, err := services.PushRandomImage(t.Context(), reg.Addr, "team/app", "v1", 2, 300<<10, push)
			require.NoError(t, err)
			layers := modelLayers(t)

			src := oci.New(opts...)
			store, err := cache.Open(t.TempDir())
			require.NoError(t, err)
			t.Cleanup(func() { store.Close() })

			for _, rest := range []string{"team/app:v1", "team/app@" + img.Digest.String()} {
				res, err := src.Resolve(t.Context(), ociRef(t, reg.Addr, rest))
				require.NoError(t, err, rest)
				require.NotNil(t, res.Image)
				assert.Equal(t, img.Digest, res.Image.Target.Digest)
				require.Len(t, res.Image.Blobs, 4, "manifest, config, two layers")
				for _, b := range res.Image.Blobs {
					_, err := store.Fetch(t.Context(), b.Descriptor, res.Blobs[b.Digest], nil)
					require.NoError(t, err, "%s %s", b.MediaType, b.Digest)
				}
				// A resumed read: the tail of a layer from an offset.
				layer := res.Image.Blobs[3]
				f, err := store.Open(layer.Digest)
				require.NoError(t, err)
				whole, err := io.ReadAll(f)
				f.Close()
				require.NoError(t, err)
				assert.Equal(t, whole[100_000:], readAll(t, res.Blobs[layer.Digest], 100_000))
			}

			for _, how := range []string{"artifactType", "v0.0.6", "v0.0.7"} {
				repo := "team/model-" + strings.ToLower(strings.ReplaceAll(how, ".", "-"))
				model := rg.pushModel(t, repo, "v1", how, layers)
				// A fresh store each time, so every blob comes from the registry.
				store, err := cache.Open(t.TempDir())
				require.NoError(t, err)
				t.Cleanup(func() { store.Close() })
				res, err := src.Resolve(t.Context(), ociRef(t, reg.Addr, repo+":v1"))
				require.NoError(t, err, how)
				assert.Equal(t, model.Digest.Encoded(), res.Model.Revision)
				var paths []string
				for _, f := range res.Model.Files {
					paths = append(paths, f.Path)
					_, err := store.Fetch(t.Context(), f.Descriptor, res.Blobs[f.Digest], nil)
					require.NoError(t, err, f.Path)
				}
				assert.Equal(t, []string{"model-00001.safetensors", "config.json", "docs/README.md"}, paths, how)
				assert.Len(t, res.Packed, 3)
				for _, l := range res.Packed {
					_, err := store.Fetch(t.Context(), l.Descriptor, res.Blobs[l.Digest], nil)
					require.NoError(t, err, l.MediaType)
				}
			}

			// The mirror's calls.
			mt, body, d, err := src.Manifest(t.Context(), agentAuth, reg.Addr, "team/app", "v1")
			require.NoError(t, err)
			assert.Equal(t, img.Digest, d)
			assert.Equal(t, digest.FromBytes(body), d)
			assert.True(t, strings.HasPrefix(mt, "application/vnd."), mt)
			_, _, _, err = src.Manifest(t.Context(), agentAuth, reg.Addr, "team/app", "absent")
			assert.ErrorIs(t, err, content.ErrNotFound)
			raw := layers[0].blob
			size, err := src.BlobSize(t.Context(), agentAuth, reg.Addr, "team/model-artifacttype", digest.FromBytes(raw))
			require.NoError(t, err)
			assert.Equal(t, int64(len(raw)), size)
			got := readAll(t, src.BlobOpener(agentAuth, reg.Addr, "team/model-artifacttype", content.Descriptor{Digest: digest.FromBytes(raw), Size: size}), 7)
			assert.True(t, bytes.Equal(raw[7:], got))
			assert.Positive(t, reg.BytesServed())

			if tokenAuth {
				_, err := oci.New().Resolve(t.Context(), ociRef(t, reg.Addr, "team/app:v1"))
				require.Error(t, err)
				assert.ErrorIs(t, err, content.ErrPermanent)
				assert.ErrorContains(t, err, "401")
				_, err = oci.New(oci.WithPullSecret(dockerConfigJSON(reg.Addr, reg.Username, "wrong"))).Resolve(t.Context(), ociRef(t, reg.Addr, "team/app:v1"))
				require.Error(t, err)
				assert.ErrorIs(t, err, content.ErrPermanent)
			}
		})
	}
}
