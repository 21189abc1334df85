package prefetch_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
)

func TestParseOCIRef(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in, canonical            string
		registry, repo, tag, dig string
		pinned                   bool
	}{
		{in: "oci://ghcr.io/org/model:v1", registry: "ghcr.io", repo: "org/model", tag: "v1"},
		{in: "oci://GHCR.io/org/model", canonical: "oci://ghcr.io/org/model:latest", registry: "ghcr.io", repo: "org/model", tag: "latest"},
		{in: "oci://127.0.0.1:5000/a/b/c:1.0-rc_1", registry: "127.0.0.1:5000", repo: "a/b/c", tag: "1.0-rc_1"},
		{in: "oci://localhost:5000/my__repo.x-y:tag", registry: "localhost:5000", repo: "my__repo.x-y", tag: "tag"},
		{in: "oci://[::1]:5000/repo:t", registry: "[::1]:5000", repo: "repo", tag: "t"},
		{in: "oci://docker.io/library/ubuntu@sha256:" + hex64, registry: "docker.io", repo: "library/ubuntu", dig: "sha256:" + hex64, pinned: true},
		{in: "oci://docker.io/library/ubuntu:22.04@sha256:" + hex64, registry: "docker.io", repo: "library/ubuntu", tag: "22.04", dig: "sha256:" + hex64, pinned: true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			t.Parallel()
			r, err := prefetch.ParseRef(tt.in)
			require.NoError(t, err)
			assert.Equal(t, prefetch.KindOCI, r.Kind)
			assert.Equal(t, tt.registry, r.Registry)
			assert.Equal(t, tt.repo, r.Repository)
			assert.Equal(t, tt.tag, r.Tag)
			assert.Equal(t, tt.dig, r.Digest.String())
			assert.Equal(t, tt.pinned, r.Pinned())
			want := tt.canonical
			if want == "" {
				want = tt.in
			}
			assert.Equal(t, want, r.String())
			assert.Equal(t, want, r.Redacted())
			again, err := prefetch.ParseRef(r.String())
			require.NoError(t, err)
			assert.Equal(t, r, again)
		})
	}
}

func TestParseHFRef(t *testing.T) {
	t.Parallel()
	commit := strings.Repeat("0a", 20)
	tests := []struct {
		in, canonical, repo, rev string
		pinned                   bool
	}{
		{in: "hf://meta-llama/Llama-3.1-8B@main", repo: "meta-llama/Llama-3.1-8B", rev: "main"},
		{in: "hf://Qwen/Qwen2.5-0.5B", canonical: "hf://Qwen/Qwen2.5-0.5B@main", repo: "Qwen/Qwen2.5-0.5B", rev: "main"},
		{in: "hf://gpt2@v1.0", repo: "gpt2", rev: "v1.0"},
		{in: "hf://org/name@refs/pr/1", repo: "org/name", rev: "refs/pr/1"},
		{in: "hf://org/name@" + commit, repo: "org/name", rev: commit, pinned: true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			t.Parallel()
			r, err := prefetch.ParseRef(tt.in)
			require.NoError(t, err)
			assert.Equal(t, prefetch.KindHF, r.Kind)
			assert.Equal(t, tt.repo, r.Repository)
			assert.Equal(t, tt.rev, r.Revision)
			assert.Equal(t, tt.pinned, r.Pinned())
			want := tt.canonical
			if want == "" {
				want = tt.in
			}
			assert.Equal(t, want, r.String())
			again, err := prefetch.ParseRef(r.String())
			require.NoError(t, err)
			assert.Equal(t, r, again)
		})
	}
}

func TestParseOCIAndHFRefInvalid(t *testing.T) {
	t.Parallel()
	tests := []struct{ in, why string }{
		{"oci://", "want oci://registry/repository"},
		{"oci://ghcr.io", "want oci://registry/repository"},
		{"oci://ghcr.io/", "want oci://registry/repository"},
		{"oci://-bad.io/repo", "not a host"},
		{"oci://ghcr.io:0/repo", "out of range"},
		{"oci://ghcr.io:70000/repo", "out of range"},
		{"oci://ghcr.io/Org/repo", "repository component \"Org\""},
		{"oci://ghcr.io/org//repo", "repository component \"\""},
		{"oci://ghcr.io/org/repo/", "repository component \"\""},
		{"oci://ghcr.io/org/re--po_", "repository component"},
		{"oci://ghcr.io/org/repo:", "tag \"\""},
		{"oci://ghcr.io/org/repo:-x", "tag"},
		{"oci://ghcr.io/org/repo:" + strings.Repeat("t", 129), "tag"},
		{"oci://ghcr.io/" + strings.Repeat("a", 256), "longer than 255"},
		{"oci://ghcr.io/org/repo@sha256:abc", "digest"},
		{"oci://ghcr.io/org/repo@sha512:" + hex64, "digest"},
		{"oci://ghcr.io/org/repo@", "digest"},
		{"hf://", "repository part"},
		{"hf://org/", "repository part"},
		{"hf://a/b/c", "want hf://org/name"},
		{"hf://org/na--me", "repository part"},
		{"hf://org/na..me", "repository part"},
		{"hf://-org/name", "repository part"},
		{"hf://org/name@", "revision"},
		{"hf://org/name@../x", "revision"},
		{"hf://org/name@a//b", "revision"},
		{"hf://org/name@/main", "revision"},
		{"hf://org/name@main/", "revision"},
		{"hf://org/name@ma%in", "revision"},
		{"hf://org/name@" + strings.Repeat("r", 256), "revision"},
		{"gs://bucket/key", "unsupported scheme"},
	}
	for _, tt := range tests {
		t.Run(tt.in[:min(len(tt.in), 60)], func(t *testing.T) {
			t.Parallel()
			_, err := prefetch.ParseRef(tt.in)
			require.Error(t, err)
			assert.True(t, errors.Is(err, cache.ErrInvalid), "%v does not wrap ErrInvalid", err)
			assert.Contains(t, err.Error(), tt.why)
		})
	}
}
