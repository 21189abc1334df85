package cache

import (
	"errors"
	"time"

	"github.com/weightd/weightd/pkg/content"
)

// DefaultChunkSize is the unit of transfer, verification and sharing.
const DefaultChunkSize = 16 << 20

// Errors of the store beside content's; test them with errors.Is.
var (
	ErrDiskFull = errors.New("cache disk full")
	ErrClosed   = errors.New("cache closed")
	// ErrSnapshotConflict is Materialize's refusal to replace a snapshot
	// that holds other files under the same name and revision.
	ErrSnapshotConflict = errors.New("a snapshot of that name and revision holds other files")
)

// Info describes a complete blob in the store.
type Info struct {
	content.Descriptor
	LastAccess time.Time `json:"lastAccess"`
	Pins       []string  `json:"pins,omitempty"`
}
