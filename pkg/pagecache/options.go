package pagecache

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
)

// Defaults of the options.
const (
	// DefaultInterval is how often Run checks residency.
	DefaultInterval = 30 * time.Second
	// DefaultWarmConcurrency is how many files are read back in at once,
	// across every check and Keep.
	DefaultWarmConcurrency = 2
	// warmChunk is the size of one read of the read-through: large and
	// sequential, the way an inference server loads its weights.
	warmChunk = 8 << 20
)

// Option configures a Tier.
type Option func(*options) error

type options struct {
	interval   time.Duration
	readers    int
	rate       int64
	mlock      bool
	logger     *slog.Logger
	registerer prometheus.Registerer
}

func defaultOptions() options {
	return options{
		interval: DefaultInterval,
		readers:  DefaultWarmConcurrency,
		mlock:    true,
		logger:   slog.New(slog.DiscardHandler),
	}
}

// WithInterval sets how often Run checks that the kept files are still in
// the page cache and reads back what the kernel dropped (default 30s).
func WithInterval(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("%w: interval %v", ErrInvalid, d)
		}
		o.interval = d
		return nil
	}
}

// WithWarmConcurrency sets how many files are read back in at once, over
// every Keep and check together (default 2). Each reader reads its file
// sequentially in 8 MiB reads.
func WithWarmConcurrency(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("%w: warm concurrency %d", ErrInvalid, n)
		}
		o.readers = n
		return nil
	}
}

// WithWarmRate bounds the bytes per second read back in, over every reader
// together; 0 (the default) leaves only the concurrency bound.
func WithWarmRate(bytesPerSecond int64) Option {
	return func(o *options) error {
		if bytesPerSecond < 0 {
			return fmt.Errorf("%w: warm rate %d bytes/s", ErrInvalid, bytesPerSecond)
		}
		o.rate = bytesPerSecond
		return nil
	}
}

// WithMlock sets whether kept files are also locked in memory with mlock
// (default true). Locking needs CAP_IPC_LOCK or a RLIMIT_MEMLOCK as large
// as the budget; where the kernel refuses, the tier falls back to re-warming.
func WithMlock(enabled bool) Option {
	return func(o *options) error {
		o.mlock = enabled
		return nil
	}
}

// WithLogger sets the logger; the tier is silent by default.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalid)
		}
		o.logger = l
		return nil
	}
}

// WithRegisterer registers the tier's metrics on r.
func WithRegisterer(r prometheus.Registerer) Option {
	return func(o *options) error {
		o.registerer = r
		return nil
	}
}

// pageSize is the kernel's page size, the unit of mincore.
var pageSize = int64(unix.Getpagesize())
