package prefetch

import (
	"cmp"
	"slices"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// FileOrder says in which order a model's files were first read the last
// times the model was loaded, so that the queue fetches those first: an
// inference server can then start reading while the rest downloads. The
// eBPF model-load tracer implements it.
//
// Order is called with the name the cache materialises the model under,
// "org/name@revision" (content.Model's Name and Revision joined by "@", as
// in JobStatus's Model and Revision); an implementation that keeps orders
// by name only may ignore what follows the last "@". It returns paths
// relative to the model directory, slash-separated and clean as in
// content.File.Path, first-read first; nil when it knows nothing. It is
// called once per job, from the job's goroutine, and must be quick and safe
// for concurrent use.
type FileOrder interface {
	Order(model string) []string
}

// WithFileOrder makes the queue fetch a model's files in the order o gives
// first, the files o does not name after them in the usual order (largest
// first). Images and packed layers keep the usual order. Default: none.
func WithFileOrder(o FileOrder) QueueOption {
	return func(c *queueConfig) { c.order = o }
}

// orderFirst moves the blobs of the files named in order to the front of
// blobs, in that order (a blob shared by several files goes where its first
// named file is); the others keep their relative order after them.
func orderFirst(blobs []fetchBlob, files []content.File, order []string) {
	if len(order) == 0 {
		return
	}
	byPath := make(map[string]digest.Digest, len(files))
	for _, f := range files {
		byPath[f.Path] = f.Digest
	}
	rank := make(map[digest.Digest]int)
	for i, p := range order {
		d, ok := byPath[p]
		if _, seen := rank[d]; ok && !seen {
			rank[d] = i
		}
	}
	slices.SortStableFunc(blobs, func(a, b fetchBlob) int {
		ra, oka := rank[a.Digest]
		rb, okb := rank[b.Digest]
		switch {
		case oka && okb:
			return cmp.Compare(ra, rb)
		case oka:
			return -1
		case okb:
			return 1
		}
		return 0
	})
}
