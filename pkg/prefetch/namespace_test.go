package prefetch_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source"
)

// TestSubmitForNamespace: jobs are shared by requests of one requester
// only, since another may not be allowed the agent's credentials.
func TestSubmitForNamespace(t *testing.T) {
	t.Parallel()
	q := prefetch.NewQueue(sourcetest.OpenStore(t), source.Sources{})
	const ref = "hf://org/model@main"
	op, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	a1, err := q.Submit(ref, prefetch.PriorityPod, prefetch.ForNamespace("team-a"))
	require.NoError(t, err)
	a2, err := q.Submit(ref, prefetch.PriorityPod, prefetch.ForNamespace("team-a"))
	require.NoError(t, err)
	b, err := q.Submit(ref, prefetch.PriorityPod, prefetch.ForNamespace("team-b"))
	require.NoError(t, err)
	again, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	assert.Same(t, a1, a2)
	assert.Same(t, op, again)
	assert.NotEqual(t, op.ID(), a1.ID())
	assert.NotEqual(t, a1.ID(), b.ID())
}
