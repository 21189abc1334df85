package source

import (
	"net/url"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

func TestSingleFileModel(t *testing.T) {
	t.Parallel()
	d := digest.Digest("sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
	tests := []struct {
		url, name, file string
	}{
		{"https://example.com:8443/v1/llama/model.bin", "example.com-8443/v1-llama-model.bin", "model.bin"},
		{"https://example.com/w.safetensors", "example.com/w.safetensors", "w.safetensors"},
		{"http://[::1]:8080/a--b/..c/x.bin", "1-8080/a-b-..c-x.bin", "x.bin"},
		{"https://example.com/%2E%2E", "example.com/file", "blob"},
		{"https://example.com/dir/%E6%A8%A1%E5%9E%8B", "example.com/dir", "blob"},
		{"https://example.com/_/.hidden.", "example.com/hidden", "hidden"},
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			t.Parallel()
			u, err := url.Parse(tt.url)
			require.NoError(t, err)
			m := SingleFileModel(u, d, 42)
			require.NoError(t, m.Validate())
			assert.Equal(t, "0123456789ab", m.Revision)
			assert.Equal(t, []content.File{{Path: tt.file, Descriptor: content.Descriptor{Digest: d, Size: 42}}}, m.Files)
			assert.Equal(t, urlModelName(u), m.Name)
			prefix, key, _ := strings.Cut(m.Name[len(tt.name):], "/")
			assert.Empty(t, prefix, "%s: want %s/<key>", m.Name, tt.name)
			assert.Regexp(t, `^[0-9a-f]{16}$`, key)
		})
	}
}

// urlModelName names a URL in three parts, which no hub model's name has,
// readable for people, and tells apart URLs that read alike.
func TestURLModelName(t *testing.T) {
	t.Parallel()
	long := "https://" + strings.Repeat("h", 200) + ".example/" + strings.Repeat("p/", 300) + "model.json"
	names := map[string]string{}
	for _, s := range []string{
		"https://models.example.com/llama-3-8b/model.json",
		"http://models.example.com/llama-3-8b/model.json",
		"https://models.example.com:443/llama-3-8b/model.json",
		"https://models.example.com/llama-3-8b-model.json",
		"https://models.example.com/llama--3-8b/model.json",
		"https://models.example.com-443/llama-3-8b/model.json",
		"https://models.example.com/Llama-3-8b/model.json",
		"https://models.example.com/llama-3-8b/model%2Ejson",
		"https://models.example.com/llama 3 8b/model.json",
		"http://[::1]:8080/a/model.json",
		"http://1:8080/a/model.json",
		long,
	} {
		u, err := parseURL(s)
		require.NoError(t, err, s)
		name := urlModelName(u)
		require.NoError(t, content.ValidateModelName(name), s)
		assert.Len(t, strings.Split(name, "/"), 3, s)
		assert.LessOrEqual(t, len("models--"+strings.ReplaceAll(name, "/", "--")), 255, "a directory name")
		if other, ok := names[name]; ok {
			t.Errorf("%s and %s are both named %s", s, other, name)
		}
		names[name] = s
	}
	u, _ := parseURL("https://models.example.com/llama-3-8b/model.json")
	assert.True(t, strings.HasPrefix(urlModelName(u), "models.example.com/llama-3-8b-model.json/"), urlModelName(u))
	for _, s := range []string{"https://models.example.com/llama-3-8b/model.json?sig=1", "https://MODELS.example.com/llama-3-8b/model.json"} {
		v, _ := parseURL(s)
		assert.Equal(t, urlModelName(u), urlModelName(v), "%s: the query and the host's case are no part of the name", s)
	}
}

// parseURL parses s with its host lower-cased, as ref.Parse does.
func parseURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		return nil, err
	}
	u.Host = strings.ToLower(u.Host)
	return u, nil
}

func TestOCIModelName(t *testing.T) {
	t.Parallel()
	for repo, want := range map[string]string{
		"llama":                "llama",
		"meta/llama-3":         "meta/llama-3",
		"models/meta/llama--3": "models.meta/llama-3",
		"a/b/c/d":              "a.b.c/d",
		"org__x/name.v1":       "org__x/name.v1",
		"_weird/-name":         "weird/name",
	} {
		got := modelName(repo)
		assert.Equal(t, want, got, repo)
		assert.NoError(t, content.ValidateModelName(got), repo)
	}
}
