package prefetch

import (
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
)

// QueueOption configures a Queue.
type QueueOption func(*queueConfig)

type queueConfig struct {
	jobs, files     int
	history         int
	resolveAttempts int
	resolveBackoff  time.Duration
	importer        Importer
	logger          *slog.Logger
	registerer      prometheus.Registerer
	tracer          trace.Tracer
	order           FileOrder
	modelLabels     int
}

// WithJobConcurrency sets how many jobs run at once (default 2; n < 1 keeps
// the default).
func WithJobConcurrency(n int) QueueOption {
	return func(c *queueConfig) {
		if n >= 1 {
			c.jobs = n
		}
	}
}

// WithFileConcurrency sets how many files of one job are fetched at once
// (default 4; n < 1 keeps the default).
func WithFileConcurrency(n int) QueueOption {
	return func(c *queueConfig) {
		if n >= 1 {
			c.files = n
		}
	}
}

// WithHistory sets how many finished jobs the queue remembers for Jobs and
// Job (default 1000; n < 0 keeps the default).
func WithHistory(n int) QueueOption {
	return func(c *queueConfig) {
		if n >= 0 {
			c.history = n
		}
	}
}

// WithResolveRetries sets how many times resolving a reference (and
// importing an image) is attempted (default 3) and the pause before the
// first retry (default 1s), doubled for each further one, with jitter: each
// pause is drawn between half and all of it, so that nodes that failed
// together do not retry together. Permanent errors are not retried; blob
// downloads are retried by the cache, not here. attempts < 1 or backoff < 0
// keep the defaults.
func WithResolveRetries(attempts int, backoff time.Duration) QueueOption {
	return func(c *queueConfig) {
		if attempts >= 1 {
			c.resolveAttempts = attempts
		}
		if backoff >= 0 {
			c.resolveBackoff = backoff
		}
	}
}

// WithImporter sets where images go once their blobs are in the store
// (default: nowhere; an image job ends ready with its blobs in the cache,
// where the registry mirror serves them).
func WithImporter(i Importer) QueueOption {
	return func(c *queueConfig) { c.importer = i }
}

// WithLogger sets the logger (default: discard).
func WithLogger(l *slog.Logger) QueueOption {
	return func(c *queueConfig) {
		if l != nil {
			c.logger = l
		}
	}
}

// WithRegisterer registers the queue's metrics on r while Run runs
// (default: not registered).
func WithRegisterer(r prometheus.Registerer) QueueOption {
	return func(c *queueConfig) { c.registerer = r }
}

// WithModelLabels sets how many distinct models keep their name in the
// model label of weightd_prefetch_ready_seconds (default 50): the first n
// models that become ready after the queue is built are named, every later
// one is counted under "other" (see LabelLimiter), so the metric has at
// most n+1 series. n < 0 keeps the default; 0 names none.
func WithModelLabels(n int) QueueOption {
	return func(c *queueConfig) {
		if n >= 0 {
			c.modelLabels = n
		}
	}
}
