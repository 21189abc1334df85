package ref_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/weightd/weightd/pkg/ref"
)

func TestParseHF(t *testing.T) {
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
			r := parseCanonical(t, tt.in, tt.canonical)
			assert.Equal(t, ref.KindHF, r.Kind)
			assert.Equal(t, tt.repo, r.Repository)
			assert.Equal(t, tt.rev, r.Revision)
			assert.Equal(t, tt.pinned, r.Pinned())
		})
	}
}

func TestParseHFInvalid(t *testing.T) {
	t.Parallel()
	testInvalid(t, []invalid{
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
	})
}
