package oci

import (
	"encoding/base64"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

func authUser(t *testing.T, a authn.Authenticator) string {
	t.Helper()
	cfg, err := a.Authorization()
	require.NoError(t, err)
	return cfg.Username + ":" + cfg.Password + ":" + cfg.IdentityToken
}

func TestKeychainLookup(t *testing.T) {
	t.Parallel()
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	auths := map[string]dockerAuth{
		"https://index.docker.io/v1/":     {Auth: b64("hub:1")},
		"registry.example.com":            {Auth: b64("plain:2")},
		"registry.example.com/team":       {Auth: b64("team:3")},
		"registry.example.com:5000":       {Username: "port", Password: "4"},
		"*.corp.example":                  {Auth: b64("glob:5")},
		"http://Insecure.Example.com:80/": {Username: "tok", IdentityToken: "idt"},
	}
	for _, tc := range []struct {
		repo string
		want string // "" for none
	}{
		{"docker.io/library/ubuntu", "hub:1:"},
		{"index.docker.io/org/app", "hub:1:"},
		{"registry.example.com/other/app", "plain:2:"},
		{"registry.example.com/team/app", "team:3:"},
		{"registry.example.com/team", "team:3:"},
		{"registry.example.com/teamx/app", "plain:2:"},
		{"registry.example.com:5000/app", "port:4:"},
		{"registry.example.com:5001/app", ""},
		{"r1.corp.example/app", "glob:5:"},
		{"a.r1.corp.example/app", ""},
		{"insecure.example.com:80/app", "tok::idt"},
		{"ghcr.io/app", ""},
	} {
		repo, err := name.NewRepository(tc.repo)
		require.NoError(t, err)
		a, ok, err := lookupAuth(auths, repo)
		require.NoError(t, err, tc.repo)
		if tc.want == "" {
			assert.False(t, ok, tc.repo)
			continue
		}
		require.True(t, ok, tc.repo)
		assert.Equal(t, tc.want, authUser(t, a), tc.repo)
	}
}

func TestKeychainOrder(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "config.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"auths":{"a.example":{"username":"file","password":"f"},"b.example":{"username":"file","password":"f"}},"credsStore":"desktop"}`), 0o600))
	k := &dockerKeychain{files: []string{filepath.Join(dir, "absent.json"), file}}
	secret, err := parseDockerConfig([]byte(`{"auths":{"a.example":{"username":"secret","password":"s"}}}`))
	require.NoError(t, err)
	k.secrets = []dockerAuths{{auths: secret}}
	legacy, err := parseDockerConfig([]byte(`{"c.example":{"auth":"` + base64.StdEncoding.EncodeToString([]byte("old:cfg")) + `"}}`))
	require.NoError(t, err)
	k.secrets = append(k.secrets, dockerAuths{auths: legacy})
	for repo, want := range map[string]string{"a.example/x": "secret:s:", "b.example/x": "file:f:", "c.example/x": "old:cfg:"} {
		r, err := name.NewRepository(repo)
		require.NoError(t, err)
		a, err := k.Resolve(r)
		require.NoError(t, err)
		assert.Equal(t, want, authUser(t, a), repo)
	}
	r, err := name.NewRepository("d.example/x")
	require.NoError(t, err)
	a, err := k.Resolve(r)
	require.NoError(t, err)
	assert.Equal(t, authn.Anonymous, a)

	// A config with helpers or other settings and no auths holds no
	// credentials.
	for _, cfg := range []string{`{"credsStore":"osxkeychain"}`, `{"currentContext":"default"}`, `{"proxies":{"default":{"httpProxy":"http://p"}}}`, `{}`} {
		none, err := parseDockerConfig([]byte(cfg))
		require.NoError(t, err, cfg)
		assert.Empty(t, none, cfg)
	}
	_, err = parseDockerConfig([]byte(`{"auths":[]}`))
	assert.ErrorIs(t, err, content.ErrInvalid)
}

func TestPlatformMatch(t *testing.T) {
	t.Parallel()
	p := func(os, arch, variant string) *ociPlatform {
		return &ociPlatform{OS: os, Architecture: arch, Variant: variant}
	}
	for _, tc := range []struct {
		node  Platform
		entry *ociPlatform
		want  int
	}{
		{Platform{"linux", "amd64", ""}, p("linux", "amd64", ""), 1},
		{Platform{"linux", "amd64", ""}, p("linux", "amd64", "v1"), 2},
		{Platform{"linux", "amd64", ""}, p("linux", "amd64", "v3"), 0},
		{Platform{"linux", "amd64", ""}, p("linux", "arm64", ""), 0},
		{Platform{"linux", "amd64", ""}, p("windows", "amd64", ""), 0},
		{Platform{"linux", "arm64", ""}, p("linux", "arm64", "v8"), 2},
		{Platform{"linux", "arm64", ""}, p("linux", "arm64", ""), 1},
		{Platform{"linux", "aarch64", ""}, p("linux", "arm64", "v8"), 2},
		{Platform{"linux", "arm", "v7"}, p("linux", "arm", "v6"), 1},
		{Platform{"linux", "arm", "v6"}, p("linux", "arm", "v7"), 0},
		{Platform{"linux", "amd64", ""}, nil, 0},
		{Platform{"linux", "amd64", ""}, p("unknown", "unknown", ""), 0},
	} {
		assert.Equal(t, tc.want, tc.node.normalize().match(tc.entry), "%v on %v", tc.entry, tc.node)
	}
	assert.Equal(t, "v8", Platform{OS: "linux", Architecture: "arm64"}.normalize().Variant)
}

func TestModelLayerTypes(t *testing.T) {
	t.Parallel()
	for mt, want := range map[string]struct {
		c       source.Compression
		archive bool
		ok      bool
	}{
		"application/vnd.cnai.model.weight.v1.raw":             {source.CompressionNone, false, true},
		"application/vnd.cnai.model.weight.v1.tar":             {source.CompressionNone, true, true},
		"application/vnd.cnai.model.weight.config.v1.tar+gzip": {source.CompressionGzip, true, true},
		"application/vnd.cnai.model.doc.v1.tar+zstd":           {source.CompressionZstd, true, true},
		"application/vnd.cncf.model.code.v1.raw":               {source.CompressionNone, false, true},
		"application/vnd.cnai.model.dataset.v1.raw":            {source.CompressionNone, false, true},
		"application/vnd.oci.image.layer.v1.tar+gzip":          {source.CompressionGzip, true, true},
		"application/vnd.cnai.model.weight.v1.tar+lz4":         {},
		"application/vnd.cnai.model.weights.v1.raw":            {},
		"application/vnd.cnai.model.weight.v2.raw":             {},
		"application/vnd.cnai.model.weight.v1":                 {},
		"application/octet-stream":                             {},
	} {
		c, archive, ok := modelLayer(mt)
		assert.Equal(t, want.ok, ok, mt)
		if ok {
			assert.Equal(t, want.c, c, mt)
			assert.Equal(t, want.archive, archive, mt)
		}
	}
}

// FuzzManifest feeds arbitrary documents through the parsing and
// classification of manifests and indexes: errors, never panics, and what
// is accepted is well formed.
func FuzzManifest(f *testing.F) {
	f.Add(MediaTypeOCIManifest, []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2}]}`))
	f.Add("", []byte(`{"schemaVersion":2,"artifactType":"application/vnd.cnai.model.config.v1+json","config":{"mediaType":"application/vnd.oci.empty.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[{"mediaType":"application/vnd.cnai.model.weight.v1.raw","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2,"annotations":{"org.cncf.model.filepath":"a/b.bin"}}]}`))
	f.Add(MediaTypeOCIIndex, []byte(`{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2,"platform":{"os":"linux","architecture":"arm64"}}]}`))
	f.Add("application/json", []byte(`{"schemaVersion":2,"manifests":[]}`))
	f.Add("", []byte(`{"schemaVersion":1}`))
	f.Fuzz(func(t *testing.T, contentType string, body []byte) {
		doc, index, err := parseOCIDocument(contentType, body)
		if err != nil {
			return
		}
		if index {
			for _, m := range doc.Manifests {
				if err := m.descriptor().Validate(); err != nil {
					t.Fatalf("accepted index entry %v: %v", m, err)
				}
			}
			for _, p := range []Platform{DefaultPlatform(), {OS: "linux", Architecture: "arm", Variant: "v7"}} {
				if e, err := selectManifest(doc, p); err == nil && e.descriptor().Validate() != nil {
					t.Fatalf("selected an invalid entry %v", e)
				}
			}
			return
		}
		if doc.Config == nil {
			t.Fatal("accepted a manifest without config")
		}
		if isModelManifest(doc) {
			files, packed, err := modelContent(doc)
			if err != nil {
				return
			}
			for _, f := range files {
				if content.ValidatePath(f.Path) != nil || f.Validate() != nil {
					t.Fatalf("accepted file %v", f)
				}
			}
			for _, l := range packed {
				if !l.Archive || l.Validate() != nil {
					t.Fatalf("accepted packed layer %v", l)
				}
			}
			return
		}
		blobs, err := imageContent(doc)
		if err != nil {
			return
		}
		for _, b := range blobs {
			if b.Validate() != nil {
				t.Fatalf("accepted blob %v", b)
			}
		}
	})
}
