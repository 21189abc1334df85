package podrequest

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
)

func refStrings(refs []ref.Ref) []string {
	out := make([]string, len(refs))
	for i, r := range refs {
		out[i] = r.String()
	}
	return out
}

func TestParse(t *testing.T) {
	t.Parallel()
	r, err := Parse(map[string]string{
		Models:         " hf://org/name@rev, oci://ghcr.io/org/model:v1 ,,hf://org/name@rev",
		PrefetchImages: "true",
		RequireWarm:    "True",
	}, []string{"busybox", "ghcr.io/org/vllm:v0.11", "busybox:latest", "localhost:5000/app@sha256:" + strings.Repeat("a", 64)})
	require.NoError(t, err)
	assert.Equal(t, []string{"hf://org/name@rev", "oci://ghcr.io/org/model:v1"}, refStrings(r.Models))
	assert.Equal(t, []string{
		"oci://docker.io/library/busybox:latest",
		"oci://ghcr.io/org/vllm:v0.11",
		"oci://localhost:5000/app@sha256:" + strings.Repeat("a", 64),
	}, refStrings(r.Images))
	assert.True(t, r.RequireWarm)
	assert.Len(t, r.Refs(), 5)

	r, err = Parse(map[string]string{"other": "x"}, []string{"busybox"})
	require.NoError(t, err)
	assert.True(t, r.Empty(), "images only on request")
}

func TestParseRejects(t *testing.T) {
	t.Parallel()
	many := make([]string, MaxRefs+1)
	for i := range many {
		many[i] = fmt.Sprintf("hf://org/m%d", i)
	}
	tests := []struct {
		name   string
		ann    map[string]string
		images []string
		want   string
	}{
		{"bad reference", map[string]string{Models: "hf://org/name, ftp://x/y"}, nil, "reference 2"},
		{"not a bool", map[string]string{PrefetchImages: "yes please"}, nil, "is not true or false"},
		{"bad warm", map[string]string{RequireWarm: "maybe"}, nil, RequireWarm},
		{"bad image", map[string]string{PrefetchImages: "true"}, []string{"busybox:bad tag!"}, "container image"},
		{"too long", map[string]string{Models: strings.Repeat("a", MaxModelsValue+1)}, nil, "more than"},
		{"too many", map[string]string{Models: strings.Join(many, ",")}, nil, "references, more than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse(tt.ann, tt.images)
			require.Error(t, err)
			assert.True(t, invalid(err), "%v", err)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

func FuzzParse(f *testing.F) {
	f.Add("hf://org/name@main, oci://r.io/a:b", "true", "nginx")
	f.Add(",,,", "false", "a/b/c:d@sha256:"+strings.Repeat("0", 64))
	f.Fuzz(func(t *testing.T, models, images, image string) {
		r, err := Parse(map[string]string{Models: models, PrefetchImages: images}, []string{image})
		if err != nil {
			if !invalid(err) {
				t.Fatalf("error %v wraps neither ref.ErrInvalid nor content.ErrInvalid", err)
			}
			return
		}
		if len(r.Refs()) > MaxRefs {
			t.Fatalf("%d references", len(r.Refs()))
		}
		for _, parsed := range r.Refs() {
			again, err := ref.Parse(parsed.String())
			if err != nil || again.String() != parsed.String() {
				t.Fatalf("reference %q does not reparse: %v", parsed, err)
			}
		}
	})
}

// invalid reports whether err wraps one of the sentinels Parse's errors
// wrap: ref.ErrInvalid for a reference, content.ErrInvalid for the rest.
func invalid(err error) bool {
	return errors.Is(err, ref.ErrInvalid) || errors.Is(err, content.ErrInvalid)
}
