package hf_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/hf"
)

// readRef returns the content of refs/<name> of model repo in store root.
func readRef(t *testing.T, root, repo, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "models", "models--"+repo, "refs", name))
	require.NoError(t, err, "refs/%s", name)
	return string(b)
}

// A branch or tag is written to refs/<name> holding the commit the hub's API
// named for it, as huggingface_hub does: offline (HF_HUB_OFFLINE=1) a loader
// finds hf://org/model@main only through refs/main → snapshots/<commit>.
func TestRefsHoldTheCommit(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	files := map[string]hubtest.Content{
		"config.json":       hubtest.String(`{"model_type": "llama"}`),
		"model.safetensors": hubtest.Generated(100_000, 1),
	}
	repo := hub.AddRepo("org/model", files)
	first := repo.Resolve("main")
	store := hfStore(t)
	src := hfSource(t, hub.URL)
	snapshot := func(commit string) string {
		return filepath.Join(store.Root(), "models", "models--org--model", "snapshots", commit)
	}

	res, err := hfResolve(t, src, "hf://org/model@main")
	require.NoError(t, err)
	dir, err := hfFetch(t, store, res)
	require.NoError(t, err)
	assert.Equal(t, snapshot(first), dir, "the snapshot is named by the commit")
	assert.Equal(t, first, readRef(t, store.Root(), "org--model", "main"), "refs/main holds the commit, no newline")
	checkDir(t, filepath.Join(filepath.Dir(dir), readRef(t, store.Root(), "org--model", "main")), files)

	// A tag of the same commit adds its ref; the snapshot stays as it is.
	repo.Tag("v1.0", first)
	res, err = hfResolve(t, src, "hf://org/model@v1.0")
	require.NoError(t, err)
	dir, err = hfFetch(t, store, res)
	require.NoError(t, err)
	assert.Equal(t, snapshot(first), dir)
	assert.Equal(t, first, readRef(t, store.Root(), "org--model", "v1.0"))
	assert.Equal(t, first, readRef(t, store.Root(), "org--model", "main"))

	// main moves on: refs/main follows it, the older snapshot and the tag stay.
	files2 := map[string]hubtest.Content{"config.json": hubtest.String(`{"model_type": "mistral"}`)}
	second := repo.Commit("main", "second", files2)
	res, err = hfResolve(t, src, "hf://org/model@main")
	require.NoError(t, err)
	dir, err = hfFetch(t, store, res)
	require.NoError(t, err)
	assert.Equal(t, snapshot(second), dir)
	assert.Equal(t, second, readRef(t, store.Root(), "org--model", "main"))
	assert.Equal(t, first, readRef(t, store.Root(), "org--model", "v1.0"))
	checkDir(t, snapshot(second), files2)
	checkDir(t, snapshot(first), files)

	// A reference pinned to a commit writes no ref: there is no branch to
	// name (huggingface_hub writes none either).
	other := hub.AddRepo("org/pinned", files)
	commit := other.Resolve("main")
	res, err = hfResolve(t, src, "hf://org/pinned@"+commit)
	require.NoError(t, err)
	dir, err = hfFetch(t, store, res)
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(store.Root(), "models", "models--org--pinned", "snapshots", commit), dir)
	refs, err := os.ReadDir(filepath.Join(store.Root(), "models", "models--org--pinned", "refs"))
	require.NoError(t, err, "an empty refs directory, which huggingface.js's scanCachedRepo needs")
	assert.Empty(t, refs)
}

// The listing shared with peers is the commit's and names no ref: the ref
// is the reference's own, set on this node whatever a peer's answer says.
func TestSharedListingCarriesNoRef(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	repo := hub.AddRepo("org/model", map[string]hubtest.Content{"config.json": hubtest.String(`{}`)})
	commit := repo.Resolve("main")

	var shared content.Model
	first := hfSource(t, hub.URL, hf.WithShared(func(ctx context.Context, _ ref.Ref, resolve func(context.Context) (content.Model, error), _ func(content.Model) error) (content.Model, error) {
		m, err := resolve(ctx)
		shared = m
		return m, err
	}))
	res, err := hfResolve(t, first, "hf://org/model@main")
	require.NoError(t, err)
	assert.Equal(t, "main", res.Model.Ref)
	assert.Empty(t, shared.Ref, "the listing given to peers names no ref")

	// A peer's answer that names a ref is taken for its files only.
	peer := shared
	peer.Ref = "evil"
	second := hfSource(t, hub.URL, hf.WithShared(fromPeer(t, peer, true)))
	for r, want := range map[string]string{"hf://org/model@main": "main", "hf://org/model@" + commit: ""} {
		res, err := hfResolve(t, second, r)
		require.NoError(t, err)
		assert.Equal(t, want, res.Model.Ref, r)
	}
}
