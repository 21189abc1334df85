package prefetch_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
)

// TestHFSharedResolve: a node that takes the listing from the node that
// resolved it asks the hub only which commit "main" is, then reads every
// file, small ones too, with ranged GETs at that commit.
func TestHFSharedResolve(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	files := modelFiles()
	repo := hub.AddRepo("org/model", files)
	commit := repo.Resolve("main")

	// The first node resolves for the cluster.
	var shared cache.Model
	first := hfSource(t, hub.URL, prefetch.WithHFShared(func(ctx context.Context, pinned prefetch.Ref, resolve func(context.Context) (cache.Model, error)) (cache.Model, error) {
		assert.Equal(t, "hf://org/model@"+commit, pinned.String(), "the shared key is the commit")
		m, err := resolve(ctx)
		shared = m
		return m, err
	}))
	_, err := hfResolve(t, first, "hf://org/model@main")
	require.NoError(t, err)
	treeCalls := hub.Stats().Requests[hubtest.RouteTree]

	// The second takes its answer.
	second := hfSource(t, hub.URL, prefetch.WithHFShared(func(context.Context, prefetch.Ref, func(context.Context) (cache.Model, error)) (cache.Model, error) {
		return shared, nil
	}))
	res, err := hfResolve(t, second, "hf://org/model@main")
	require.NoError(t, err)
	assert.Equal(t, treeCalls, hub.Stats().Requests[hubtest.RouteTree], "no listing asked of the hub")
	dir, err := hfFetch(t, hfStore(t), res)
	require.NoError(t, err)
	checkDir(t, dir, files)

	// An answer for another commit is refused.
	wrong := shared
	wrong.Revision = "0123456789012345678901234567890123456789"
	third := hfSource(t, hub.URL, prefetch.WithHFShared(func(context.Context, prefetch.Ref, func(context.Context) (cache.Model, error)) (cache.Model, error) {
		return wrong, nil
	}))
	_, err = hfResolve(t, third, "hf://org/model@main")
	require.ErrorIs(t, err, cache.ErrInvalid)
}
