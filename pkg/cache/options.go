package cache

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/content"
)

// Option configures a Store.
type Option func(*options) error

type options struct {
	chunkSize     int64
	budgetBytes   int64
	budgetPercent float64
	logger        *slog.Logger
	registerer    prometheus.Registerer
	stallTimeout  time.Duration
	attempts      int
	backoff       time.Duration
	checkpoint    time.Duration
	events        func(Event)
	// accessGranularity is how far the last access recorded in the index
	// may trail the one in memory (see touchAll).
	accessGranularity time.Duration

	// minFreeBytes and minFreePercent are the floor of free space the
	// store leaves on its filesystem (the larger of the two).
	minFreeBytes   int64
	minFreePercent float64
}

func defaultOptions() options {
	return options{
		chunkSize:     DefaultChunkSize,
		budgetPercent: 80,
		logger:        slog.New(slog.DiscardHandler),
		stallTimeout:  30 * time.Second,
		attempts:      5,
		backoff:       500 * time.Millisecond,
		checkpoint:    time.Second,

		accessGranularity: DefaultAccessGranularity,
	}
}

// DefaultAccessGranularity is how stale the last access of a blob recorded
// in the index may be: a blob used again within it is not written again.
// The store's own LRU order, in memory, is exact; it is the order after a
// crash (Close writes what is left) that is only this precise.
const DefaultAccessGranularity = 5 * time.Second

// withAccessGranularity sets the access granularity (tests).
func withAccessGranularity(d time.Duration) Option {
	return func(o *options) error {
		if d < 0 {
			return fmt.Errorf("%w: access granularity %v", content.ErrInvalid, d)
		}
		o.accessGranularity = d
		return nil
	}
}

// WithChunkSize sets the chunk size: the unit of verification, resumption and
// sharing. It must be a positive multiple of 64 KiB.
func WithChunkSize(n int64) Option {
	return func(o *options) error {
		if n <= 0 || n%(64<<10) != 0 {
			return fmt.Errorf("%w: chunk size %d is not a positive multiple of 64 KiB", content.ErrInvalid, n)
		}
		o.chunkSize = n
		return nil
	}
}

// WithBudget bounds the disk the store may use: at most maxBytes (0 for no
// byte limit) and at most maxPercent of the filesystem's size (0 for no
// percentage limit). The default is 80% of the filesystem.
func WithBudget(maxBytes int64, maxPercent float64) Option {
	return func(o *options) error {
		if maxBytes < 0 || maxPercent < 0 || maxPercent > 100 {
			return fmt.Errorf("%w: budget %d bytes, %v%%", content.ErrInvalid, maxBytes, maxPercent)
		}
		o.budgetBytes, o.budgetPercent = maxBytes, maxPercent
		return nil
	}
}

// The free-space floor the agent keeps by default (cmd/weightd's
// --min-free-percent): the kubelet evicts pods once less than
// KubeletNodefsAvailablePercent of the node's filesystem is free (its
// default hard eviction threshold nodefs.available<10%), and the cache
// stops MinFreeMarginPercent points above that: at the kubelet's image
// garbage collection threshold (85% used) where containerd's images share
// the filesystem, as they do when the cache hard-links image layers into
// containerd. A larger margin would refuse fetches on nodes whose disks
// images already fill to 80%, which the kubelet itself tolerates.
const (
	KubeletNodefsAvailablePercent = 10
	MinFreeMarginPercent          = 5
	DefaultMinFreePercent         = KubeletNodefsAvailablePercent + MinFreeMarginPercent
)

// WithMinFree sets a floor of free space on the store's filesystem: the
// larger of minBytes and minPercent of the filesystem's size. A download
// that would bring free space below it evicts least recently used blobs
// first, and one that cannot fit above it even so is refused (ErrDiskFull)
// before anything is evicted. Others' writes can still take free space
// below it; the store then evicts to restore it with its next download.
// The store keeps no floor by default; the agent keeps
// DefaultMinFreePercent.
func WithMinFree(minBytes int64, minPercent float64) Option {
	return func(o *options) error {
		if minBytes < 0 || minPercent < 0 || minPercent >= 100 {
			return fmt.Errorf("%w: free-space floor %d bytes, %v%%", content.ErrInvalid, minBytes, minPercent)
		}
		o.minFreeBytes, o.minFreePercent = minBytes, minPercent
		return nil
	}
}

// WithLogger sets the logger; the store is silent by default.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", content.ErrInvalid)
		}
		o.logger = l
		return nil
	}
}

// WithRegisterer registers the store's metrics on r.
func WithRegisterer(r prometheus.Registerer) Option {
	return func(o *options) error {
		o.registerer = r
		return nil
	}
}

// WithStallTimeout sets how long a source may send nothing before the
// request is abandoned and retried from the last byte received.
func WithStallTimeout(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("%w: stall timeout %v", content.ErrInvalid, d)
		}
		o.stallTimeout = d
		return nil
	}
}

// WithRetries sets how many consecutive failed attempts without progress a
// download survives, and the first backoff between them (doubled each time,
// with jitter).
func WithRetries(attempts int, backoff time.Duration) Option {
	return func(o *options) error {
		if attempts < 1 || backoff < 0 {
			return fmt.Errorf("%w: retries %d, backoff %v", content.ErrInvalid, attempts, backoff)
		}
		o.attempts, o.backoff = attempts, backoff
		return nil
	}
}

// WithCheckpointInterval sets how often an ongoing download persists its
// progress (fsync of the data, then of the state). A crash loses at most this
// much work. The default is one second.
func WithCheckpointInterval(d time.Duration) Option {
	return func(o *options) error {
		if d < 0 {
			return fmt.Errorf("%w: checkpoint interval %v", content.ErrInvalid, d)
		}
		o.checkpoint = d
		return nil
	}
}

// WithEvents calls fn when the store starts downloading a blob, verifies a
// chunk of it, completes it, or drops it: what a node announces to its peers.
// fn runs on the store's goroutines and must not block.
func WithEvents(fn func(Event)) Option {
	return func(o *options) error {
		o.events = fn
		return nil
	}
}
