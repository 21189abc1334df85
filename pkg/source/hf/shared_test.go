package hf_test

import (
	"context"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
)

// TestSharedResolve: a node that takes the listing from the node that
// resolved it asks the hub which commit "main" is and for the listing at
// that commit, to check the one it took, but reads no file while
// resolving; it then reads every file, small ones too, with ranged GETs at
// that commit, and checks the small ones against the hub's git blob ids.
func TestSharedResolve(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	files := modelFiles()
	repo := hub.AddRepo("org/model", files)
	commit := repo.Resolve("main")

	// The first node resolves for the cluster.
	var shared content.Model
	first := hfSource(t, hub.URL, hf.WithShared(func(ctx context.Context, pinned ref.Ref, resolve func(context.Context) (content.Model, error), _ func(content.Model) error) (content.Model, error) {
		assert.Equal(t, "hf://org/model@"+commit, pinned.String(), "the shared key is the commit")
		m, err := resolve(ctx)
		shared = m
		return m, err
	}))
	_, err := hfResolve(t, first, "hf://org/model@main")
	require.NoError(t, err)
	treeCalls, fileReads := hub.Stats().Requests[hubtest.RouteTree], hub.Stats().Requests[hubtest.RouteResolve]

	// The second takes its answer.
	second := hfSource(t, hub.URL, hf.WithShared(fromPeer(t, shared, true)))
	res, err := hfResolve(t, second, "hf://org/model@main")
	require.NoError(t, err)
	assert.Equal(t, treeCalls+1, hub.Stats().Requests[hubtest.RouteTree], "the listing is asked of the hub once, to check")
	assert.Equal(t, fileReads, hub.Stats().Requests[hubtest.RouteResolve], "no file read while resolving")
	dir, err := hfFetch(t, hfStore(t), res)
	require.NoError(t, err)
	checkDir(t, dir, files)

	// An answer for another commit, or with other files, is not used: the
	// node resolves from the hub.
	wrongCommit := shared
	wrongCommit.Revision = "0123456789012345678901234567890123456789"
	wrongFiles := shared
	wrongFiles.Files = shared.Files[1:]
	for _, wrong := range []content.Model{wrongCommit, wrongFiles} {
		third := hfSource(t, hub.URL, hf.WithShared(fromPeer(t, wrong, false)))
		res, err = hfResolve(t, third, "hf://org/model@main")
		require.NoError(t, err)
		assert.Equal(t, shared.Files, res.Model.Files)
		assert.Nil(t, res.Verify, "the hub's own listing needs no check")
	}
}

// TestSharedResolveSmallFileLie: another node's listing has the hub's
// paths and sizes, but its own bytes for a file stored in git, which the hub
// names only by its git blob id. Verify refuses them once they are in the
// store, and the source then resolves that commit from the hub alone.
func TestSharedResolveSmallFileLie(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	honest := `{"hidden_size": 1024}`
	evil := `{"auto_map": "evil!"}`
	require.Len(t, evil, len(honest))
	hub.AddRepo("org/model", map[string]hubtest.Content{"config.json": hubtest.String(honest)})

	var shared content.Model
	_, err := hfResolve(t, hfSource(t, hub.URL, hf.WithShared(func(ctx context.Context, _ ref.Ref, resolve func(context.Context) (content.Model, error), _ func(content.Model) error) (content.Model, error) {
		m, err := resolve(ctx)
		shared = m
		return m, err
	})), "hf://org/model@main")
	require.NoError(t, err)
	lie := shared
	lie.Files = []content.File{{Path: "config.json", Descriptor: content.Descriptor{Digest: digest.FromString(evil), Size: int64(len(evil))}}}

	src := hfSource(t, hub.URL, hf.WithShared(fromPeer(t, lie, true)))
	store := hfStore(t)
	_, err = store.Fetch(t.Context(), lie.Files[0].Descriptor, cache.Bytes([]byte(evil)), nil) // there from another fetch
	require.NoError(t, err)
	res, err := hfResolve(t, src, "hf://org/model@main")
	require.NoError(t, err)
	require.NotNil(t, res.Verify)
	_, err = hfFetch(t, store, res)
	require.ErrorIs(t, err, source.ErrUnverified)

	res, err = hfResolve(t, src, "hf://org/model@main")
	require.NoError(t, err)
	assert.Nil(t, res.Verify, "resolved from the hub alone")
	dir, err := hfFetch(t, store, res)
	require.NoError(t, err)
	checkDir(t, dir, map[string]hubtest.Content{"config.json": hubtest.String(honest)})
}

// fromPeer is a SharedResolver whose peer answers m, as p2p.Swarm's: m if
// the source accepts it, else the source's own resolution. accepted is
// whether the source must accept it.
func fromPeer(t *testing.T, m content.Model, accepted bool) hf.SharedResolver {
	return func(ctx context.Context, _ ref.Ref, resolve func(context.Context) (content.Model, error), accept func(content.Model) error) (content.Model, error) {
		err := accept(m)
		if accepted {
			assert.NoError(t, err, "the source refused the peer's answer")
		} else {
			assert.Error(t, err, "the source accepted the peer's answer")
		}
		if err != nil {
			return resolve(ctx)
		}
		return m, nil
	}
}
