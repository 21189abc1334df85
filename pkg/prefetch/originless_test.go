package prefetch

import (
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

// TestCheckWithoutOrigin: only a file pinned by digest is taken from
// another node while its origin is down, and only as exactly that file.
func TestCheckWithoutOrigin(t *testing.T) {
	t.Parallel()
	d := digest.FromString("adapter")
	pinned, err := ref.Parse("https://files.example/a/adapter.bin#" + d.String())
	require.NoError(t, err)
	honest := source.SingleFileModel(pinned.URL, d, 7)
	require.NoError(t, CheckWithoutOrigin(pinned, honest))

	extra := honest
	extra.Files = append(extra.Files, content.File{Path: "run.py", Descriptor: content.Descriptor{Digest: digest.FromString("x"), Size: 1}})
	renamed := honest
	renamed.Files = []content.File{{Path: "config.json", Descriptor: honest.Files[0].Descriptor}}
	otherName := honest
	otherName.Name = "org/model"
	withRef := honest
	withRef.Ref = "main"
	for _, m := range []content.Model{extra, renamed, otherName, withRef, {}} {
		require.ErrorIs(t, CheckWithoutOrigin(pinned, m), content.ErrInvalid, "%+v", m)
	}

	for _, s := range []string{"https://files.example/model.json", "hf://org/model@0123456789012345678901234567890123456789",
		"oci://registry.example/org/model@" + d.String()} {
		r, err := ref.Parse(s)
		require.NoError(t, err)
		require.ErrorIs(t, NeedsOrigin(r), ErrNeedsOrigin, s)
		require.ErrorIs(t, CheckWithoutOrigin(r, honest), ErrNeedsOrigin, s)
	}
}
