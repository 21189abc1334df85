package mirror

import (
	"context"
	"os"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// nullStore holds nothing: for tests that must never reach the cache.
type nullStore struct{}

func newNullStore() nullStore { return nullStore{} }

func (nullStore) Stat(d digest.Digest) (cache.Info, error) { return cache.Info{}, content.ErrNotFound }
func (nullStore) Open(d digest.Digest) (*os.File, error)   { return nil, content.ErrNotFound }
func (nullStore) OpenChunk(d digest.Digest, i int) (*os.File, int64, int64, error) {
	return nil, 0, 0, content.ErrNotFound
}
func (nullStore) ChunkState(d digest.Digest) (cache.ChunkState, error) {
	return cache.ChunkState{}, content.ErrNotFound
}
func (nullStore) Fetch(context.Context, content.Descriptor, content.RangeOpener, content.Progress) (cache.Info, error) {
	return cache.Info{}, content.ErrNotFound
}

func toFloat(c prometheus.Collector) float64 { return testutil.ToFloat64(c) }
