package prefetch

import (
	"context"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
)

// Source resolves references of the kinds it knows to files and readers.
// Implementations must be safe for concurrent use.
type Source interface {
	// Resolve looks the reference up at its origin. A reference of a kind
	// the source does not handle is an error wrapping errors.ErrUnsupported;
	// errors that retrying cannot fix are wrapped with cache.Permanent.
	Resolve(ctx context.Context, ref Ref) (*Resolution, error)
}

// Resolution is a reference resolved to a model: its files, and one opener
// per distinct blob (files with the same digest share a blob).
type Resolution struct {
	Model cache.Model
	Blobs map[digest.Digest]cache.RangeOpener
}
