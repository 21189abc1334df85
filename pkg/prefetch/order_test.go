package prefetch_test

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
)

// staticOrder is a FileOrder from a map; it records what it was asked.
type staticOrder struct {
	orders map[string][]string
	mu     sync.Mutex
	asked  []string
}

func (o *staticOrder) Order(model string) []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.asked = append(o.asked, model)
	return o.orders[model]
}

func fetchedSizes(s *fakeStore) []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var sizes []int64
	for _, d := range s.fetched {
		sizes = append(sizes, d.Size)
	}
	return sizes
}

func TestQueueFileOrder(t *testing.T) {
	t.Parallel()
	// Files f0…f6 of sizes 10, 50, 30, 70, 20, 60, 40; f7 shares f0's blob.
	m := model("m", 10, 50, 30, 70, 20, 60, 40, 10)
	order := &staticOrder{orders: map[string][]string{
		// First read: f4 (20), the shared f7 (10), f2 (30); names the model
		// does not have are ignored, and so is a second mention.
		"org/m@main": {"config.json", "f4", "f7", "f2", "f4", "f0"},
	}}
	store := &fakeStore{}
	src := &fakeSource{models: map[string]content.Model{"m": m, "n": model("n", 10, 50, 30)}}
	q := prefetch.NewQueue(store, src, prefetch.WithFileConcurrency(1), prefetch.WithFileOrder(order))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(refFor("m"), prefetch.PriorityNormal)
	require.NoError(t, err)
	st, err := sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Equal(t, 8, st.FilesDone)
	assert.Equal(t, []int64{20, 10, 30, 70, 60, 50, 40}, fetchedSizes(store), "first-read files first, then largest first")

	// A model the order does not know keeps the usual order.
	store.mu.Lock()
	store.fetched = nil
	store.mu.Unlock()
	j, err = q.Submit(refFor("n"), prefetch.PriorityNormal)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Equal(t, []int64{50, 30, 10}, fetchedSizes(store))
	order.mu.Lock()
	assert.Equal(t, []string{"org/m@main", "org/n@main"}, order.asked, "asked by the materialised name")
	order.mu.Unlock()
}

func TestQueueFileOrderSkipsImages(t *testing.T) {
	t.Parallel()
	order := &staticOrder{}
	store := sourcetest.OpenStore(t)
	q := prefetch.NewQueue(store, imageSource{imageResolution()}, prefetch.WithFileOrder(order))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit("oci://registry.example/org/app:v1", prefetch.PriorityPod)
	require.NoError(t, err)
	_, err = sourcetest.Wait(t, j)
	require.NoError(t, err)
	assert.Empty(t, order.asked, "an image's blobs keep their order: documents first")
}
