package ref_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/weightd/weightd/pkg/ref"
)

func TestParseOCI(t *testing.T) {
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
			r := parseCanonical(t, tt.in, tt.canonical)
			assert.Equal(t, ref.KindOCI, r.Kind)
			assert.Equal(t, tt.registry, r.Registry)
			assert.Equal(t, tt.repo, r.Repository)
			assert.Equal(t, tt.tag, r.Tag)
			assert.Equal(t, tt.dig, r.Digest.String())
			assert.Equal(t, tt.pinned, r.Pinned())
			assert.Equal(t, r.String(), r.Redacted())
		})
	}
}

func TestParseOCIInvalid(t *testing.T) {
	t.Parallel()
	testInvalid(t, []invalid{
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
	})
}
