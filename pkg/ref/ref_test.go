package ref_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/ref"
)

const hex64 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// parseCanonical parses in, which must parse, and checks that its canonical
// form is want (in itself when want is "") and parses as the same
// reference.
func parseCanonical(t *testing.T, in, want string) ref.Ref {
	t.Helper()
	r, err := ref.Parse(in)
	require.NoError(t, err)
	if want == "" {
		want = in
	}
	assert.Equal(t, want, r.String())
	again, err := ref.Parse(r.String())
	require.NoError(t, err)
	assert.Equal(t, r, again)
	return r
}

// invalid is a reference that must not parse, and a part of the reason its
// error must give.
type invalid struct{ in, why string }

func testInvalid(t *testing.T, tests []invalid) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.in[:min(len(tt.in), 60)], func(t *testing.T) {
			t.Parallel()
			_, err := ref.Parse(tt.in)
			require.Error(t, err)
			assert.ErrorIs(t, err, ref.ErrInvalid)
			assert.ErrorContains(t, err, tt.why)
			assert.True(t, strings.HasPrefix(err.Error(), "parsing reference "), err.Error())
			assert.Less(t, len(err.Error()), 400, "errors quote a truncated reference")
		})
	}
}

func TestParseHTTP(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in        string
		canonical string // "" means the input itself
		digest    string
	}{
		{in: "https://example.com/models/llama/model.json"},
		{in: "http://127.0.0.1:8080/m/model.json"},
		{in: "https://[::1]:8443/model.json"},
		{in: "HTTPS://Example.COM/Path/Model.json", canonical: "https://example.com/Path/Model.json"},
		{in: "https://bucket.s3.amazonaws.com/w/model.bin?X-Amz-Signature=abc&X-Amz-Expires=60#sha256:" + hex64, digest: "sha256:" + hex64},
		{in: "https://example.com/a%20b/file.bin#sha256:" + hex64, digest: "sha256:" + hex64},
		{in: "https://example.com/model.json?"},
		{in: "https://example.com/" + strings.Repeat("a", ref.MaxLength-len("https://example.com/"))},
	}
	for _, tt := range tests {
		t.Run(tt.in[:min(len(tt.in), 60)], func(t *testing.T) {
			t.Parallel()
			r := parseCanonical(t, tt.in, tt.canonical)
			assert.Equal(t, ref.KindHTTP, r.Kind)
			assert.Equal(t, tt.digest, r.Digest.String())
		})
	}
}

func TestParseInvalid(t *testing.T) {
	t.Parallel()
	testInvalid(t, []invalid{
		{"", "not of the form"},
		{"example.com/model.json", "not of the form"},
		{"ftp://example.com/model.json", "unsupported scheme"},
		{"gs://bucket/model.bin", "unsupported scheme"},
		{"s3://", "bucket"},
		{"s3://ab/m", "bucket"},
		{"s3://Models/m", "bucket"},
		{"s3://my_bucket/m", "bucket"},
		{"s3://-models/m", "bucket"},
		{"s3://a..b/m", "two adjacent periods"},
		{"s3://192.168.1.1/m", "IP address"},
		{"s3://models:9000/m", "bucket"},
		{"s3://models//m", "empty"},
		{"s3://models/a//b", "empty"},
		{"s3://models/a/../b", `".."`},
		{"s3://models/./b", `".."`},
		{"s3://models/a?b", "not allowed"},
		{"s3://models/a\\b", "not allowed"},
		{"s3://models/m@", "version"},
		{"s3://models/m@v 1", "printable ASCII"},
		{"s3://models/m@v*1", "version"},
		{"s3://models/m@v1@v2", "version"},
		{"s3://models/m@" + strings.Repeat("v", 1025), "version"},
		{"s3://models/" + strings.Repeat("a", 1025), "longer than 1024"},
		{"s3://models#sha256:" + hex64, "must name an object key"},
		{"s3://models/m.bin#sha256:" + hex64[:10], "fragment must be a sha256 digest"},
		{"s3://models/m.bin@v1#sha256:" + hex64, "give one, not both"},
		{"https:/example.com/model.json", "not of the form"},
		{"https:///model.json", "host is missing"},
		{"https://:443/model.json", "host is missing"},
		{"https://example.com:/model.json", "empty port"},
		{"https://example.com:http/model.json", "invalid port"},
		{"https://example.com:0/model.json", "out of range"},
		{"https://example.com:65536/model.json", "out of range"},
		{"https://example.com:99999999999999999999/model.json", "out of range"},
		{"https://user:pass@example.com/model.json", "user information"},
		{"https://user@example.com/model.json", "user information"},
		{"https://example.com", "must name a file"},
		{"https://example.com/", "must name a file"},
		{"https://example.com/models/", "must name a file"},
		{"https://example.com/model.json ", "printable ASCII"},
		{"https://example.com/mo del.json", "printable ASCII"},
		{"https://example.com/model.json\n", "printable ASCII"},
		{"https://example.com/mödel.json", "printable ASCII"},
		{"https://example.com/\x00", "printable ASCII"},
		{"https://example.com/%zz", "invalid URL escape"},
		{"https://example.com/" + strings.Repeat("a", ref.MaxLength), "longer than"},
		{"https://example.com/file.bin#", "fragment must be a sha256 digest"},
		{"https://example.com/file.bin#abc", "fragment must be a sha256 digest"},
		{"https://example.com/file.bin#sha256:" + strings.ToUpper(hex64), "fragment must be a sha256 digest"},
		{"https://example.com/file.bin#sha256:" + hex64[:63], "fragment must be a sha256 digest"},
		{"https://example.com/file.bin#sha512:" + hex64 + hex64, "fragment must be a sha256 digest"},
		{"https://example.com/file.bin#sha256:" + hex64 + "#x", "fragment must be a sha256 digest"},
		{"https://example.com/file.bin#sha256%3A" + hex64, "fragment must be a sha256 digest"},
	})
}

func TestParseS3(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in, canonical, bucket, prefix, version, digest string
	}{
		{in: "s3://models/llama/v1", bucket: "models", prefix: "llama/v1"},
		{in: "S3://models/llama/v1/", canonical: "s3://models/llama/v1", bucket: "models", prefix: "llama/v1"},
		{in: "s3://models", bucket: "models"},
		{in: "s3://models/", canonical: "s3://models", bucket: "models"},
		{in: "s3://my.bucket-1/Org/Model_v2.0", bucket: "my.bucket-1", prefix: "Org/Model_v2.0"},
		{in: "s3://models/m@3/L4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY=", bucket: "models", prefix: "m", version: "3/L4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY="},
		{in: "s3://models@null", bucket: "models", version: "null"},
		{in: "s3://models/m/model.bin#sha256:" + hex64, bucket: "models", prefix: "m/model.bin", digest: "sha256:" + hex64},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			t.Parallel()
			r := parseCanonical(t, tt.in, tt.canonical)
			assert.Equal(t, ref.KindS3, r.Kind)
			assert.Equal(t, tt.bucket, r.URL.Host)
			assert.Equal(t, "/"+tt.prefix, r.URL.Path)
			assert.Equal(t, tt.version, r.Revision)
			assert.Equal(t, tt.digest, r.Digest.String())
			assert.Equal(t, r.String(), r.Redacted())
			assert.Equal(t, tt.prefix, r.KeyPrefix())
		})
	}
}

func TestRedacted(t *testing.T) {
	t.Parallel()
	r, err := ref.Parse("https://b.example/w.bin?X-Amz-Signature=secret#sha256:" + hex64)
	require.NoError(t, err)
	assert.Equal(t, "https://b.example/w.bin?REDACTED#sha256:"+hex64, r.Redacted())
	assert.Contains(t, r.String(), "secret", "String is the canonical reference, query included")

	r, err = ref.Parse("https://b.example/model.json")
	require.NoError(t, err)
	assert.Equal(t, r.String(), r.Redacted())
	assert.Empty(t, ref.Ref{}.String())
}

func TestOrigin(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"oci://Registry.Example:5000/team/llama:v1": "registry.example:5000",
		"oci://registry-1.docker.io/library/x:v1":   "docker.io", // one service, one limit
		"oci://Index.Docker.io/library/x:v1":        "docker.io",
		"oci://docker.io/library/x:v1":              "docker.io",
		"hf://meta-llama/Llama-3-8B@main":           "hf",
		"s3://weights/llama":                        "s3",
		"https://Weights.Example.com/model.json":    "weights.example.com",
	} {
		r, err := ref.Parse(in)
		require.NoError(t, err)
		assert.Equal(t, want, r.Origin(), in)
	}
	assert.Empty(t, ref.Ref{}.Origin())
}

func ExampleParse() {
	r, err := ref.Parse("HTTPS://Weights.Example.com/llama/model-00001-of-00002.safetensors#sha256:" + hex64)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(r.Kind, r.URL.Host, r.Digest.Encoded()[:12])
	fmt.Println(r)

	_, err = ref.Parse("https://user:secret@example.com/model.json")
	fmt.Println(errors.Is(err, ref.ErrInvalid))
	// Output:
	// http weights.example.com 0123456789ab
	// https://weights.example.com/llama/model-00001-of-00002.safetensors#sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
	// true
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"https://example.com/models/llama/model.json",
		"http://127.0.0.1:8080/m/model.json",
		"https://[::1]:8443/model.json",
		"https://[fe80::1%25en0]/model.json",
		"HTTPS://Example.COM/Path/Model.json",
		"https://bucket.s3.amazonaws.com/w/model.bin?X-Amz-Signature=abc&X-Amz-Expires=60#sha256:" + hex64,
		"https://example.com/a%20b/file.bin#sha256:" + hex64,
		"https://example.com/a%2Fb/c;d,e/f:g@h/model.json",
		"https://example.com/model.json?",
		"https://example.com/model.json?a=%zz",
		"https://user:pass@example.com/model.json",
		"https://example.com/file.bin#sha256:" + strings.ToUpper(hex64),
		"https://example.com:/model.json",
		"https:///model.json",
		"https:model.json",
		"oci://registry.example.com/repo:tag",
		"oci://127.0.0.1:5000/a/b:1@sha256:" + hex64,
		"oci://[::1]:5000/repo",
		"hf://org/name@main",
		"hf://gpt2@refs/pr/1",
		"s3://models/llama/v1",
		"s3://models/llama/v1/",
		"s3://models",
		"s3://models/m@3/L4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY=",
		"s3://models/m/model.bin#sha256:" + hex64,
		"s3://models/m@v1#sha256:" + hex64,
		"s3://a..b/m",
		"s3://models/a/../b",
		"s3://1.2.3.4/m",
		"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ref.Parse(s)
		if err != nil {
			if !errors.Is(err, ref.ErrInvalid) {
				t.Fatalf("error %v does not wrap ref.ErrInvalid", err)
			}
			return
		}
		switch r.Kind {
		case ref.KindHTTP:
			if r.URL == nil || r.URL.User != nil || r.URL.Host == "" || r.URL.Fragment != "" {
				t.Fatalf("accepted %q with URL %#v", s, r.URL)
			}
		case ref.KindOCI:
			if r.URL != nil || r.Registry == "" || r.Repository == "" || (r.Tag == "" && r.Digest == "") ||
				strings.ContainsAny(r.Registry+r.Repository+r.Tag, "@#?\\ ") || strings.Contains(r.Repository, "..") {
				t.Fatalf("accepted %q as %+v", s, r)
			}
		case ref.KindHF:
			if r.URL != nil || r.Repository == "" || r.Revision == "" || r.Digest != "" ||
				strings.Contains(r.Repository+r.Revision, "..") || strings.ContainsAny(r.Repository+r.Revision, "@#?%\\ ") {
				t.Fatalf("accepted %q as %+v", s, r)
			}
		case ref.KindS3:
			if r.URL == nil || r.URL.Scheme != "s3" || len(r.URL.Host) < 3 || !strings.HasPrefix(r.URL.Path, "/") ||
				strings.Contains(r.URL.Path, "//") || strings.Contains(r.URL.Path, "/../") || strings.HasSuffix(r.URL.Path, "/..") ||
				strings.ContainsAny(r.URL.Path, "@#?\\") || strings.Trim(r.URL.Host, "abcdefghijklmnopqrstuvwxyz0123456789.-") != "" || (r.Digest != "" && r.Revision != "") {
				t.Fatalf("accepted %q as %+v", s, r)
			}
		default:
			t.Fatalf("accepted %q as kind %q", s, r.Kind)
		}
		if r.Digest != "" {
			if err := r.Digest.Validate(); err != nil || r.Digest.Algorithm() != digest.SHA256 {
				t.Fatalf("accepted %q with digest %q: %v", s, r.Digest, err)
			}
		}
		canon := r.String()
		again, err := ref.Parse(canon)
		if err != nil {
			t.Fatalf("canonical form %q of %q does not parse: %v", canon, s, err)
		}
		if again.String() != canon || again.Digest != r.Digest {
			t.Fatalf("%q: canonical form %q reparses as %q", s, canon, again.String())
		}
		if len(r.Redacted()) > len(canon)+len("REDACTED") {
			t.Fatalf("redacted form %q longer than expected", r.Redacted())
		}
	})
}
