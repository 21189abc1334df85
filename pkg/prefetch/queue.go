package prefetch

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/cache"
)

// Store is what the queue needs of the cache; *cache.Store provides it.
type Store interface {
	// Fetch makes the blob present, downloading it from src if needed.
	Fetch(ctx context.Context, desc cache.Descriptor, src cache.RangeOpener, progress cache.Progress) (cache.Info, error)
	// Materialize lays out a model whose blobs are all present and returns
	// its directory.
	Materialize(m cache.Model) (string, error)
	// Hold keeps a blob from eviction, present or not yet, until released:
	// a model's first files must survive while its last ones download.
	Hold(d digest.Digest) (release func())
}

// ErrQueueStopped is returned by Submit once the queue's Run has returned,
// and is the error of jobs still queued then.
var ErrQueueStopped = errors.New("prefetch queue stopped")

// Queue defaults.
const (
	DefaultJobConcurrency  = 2
	DefaultFileConcurrency = 4
	DefaultHistory         = 1000
	DefaultResolveAttempts = 3
	DefaultResolveBackoff  = time.Second
)

// QueueOption configures a Queue.
type QueueOption func(*queueConfig)

type queueConfig struct {
	jobs, files     int
	history         int
	resolveAttempts int
	resolveBackoff  time.Duration
	logger          *slog.Logger
	registerer      prometheus.Registerer
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

// WithResolveRetries sets how many times resolving a reference is attempted
// (default 3) and the pause before the first retry (default 1s), doubled for
// each further one. Permanent errors are not retried; blob downloads are
// retried by the cache, not here. attempts < 1 or backoff < 0 keep the
// defaults.
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

// Queue runs prefetch jobs: resolve a reference, fetch its files into the
// store, materialise the model. Submit may be called before and while Run
// runs; its methods are safe for concurrent use.
type Queue struct {
	store   Store
	src     Source
	cfg     queueConfig
	metrics queueMetrics

	mu       sync.Mutex
	running  bool
	stopped  bool
	pending  []*Job          // FIFO
	active   map[string]*Job // canonical ref → unfinished job
	jobs     map[string]*Job // ID → unfinished or remembered job
	finished []*Job          // remembered finished jobs, oldest first
	wake     chan struct{}   // capacity 1: pending is not empty
}

// NewQueue returns a queue that fetches into store what src resolves. It
// starts nothing: call Run.
func NewQueue(store Store, src Source, opts ...QueueOption) *Queue {
	cfg := queueConfig{
		jobs:            DefaultJobConcurrency,
		files:           DefaultFileConcurrency,
		history:         DefaultHistory,
		resolveAttempts: DefaultResolveAttempts,
		resolveBackoff:  DefaultResolveBackoff,
		logger:          slog.New(slog.DiscardHandler),
	}
	for _, o := range opts {
		o(&cfg)
	}
	return &Queue{
		store:   store,
		src:     src,
		cfg:     cfg,
		metrics: newQueueMetrics(),
		active:  make(map[string]*Job),
		jobs:    make(map[string]*Job),
		wake:    make(chan struct{}, 1),
	}
}

// Run runs jobs until ctx ends, then waits for the running ones to stop
// (they fail with ctx's error), fails the ones still queued with
// ErrQueueStopped and returns nil. It may be called once.
func (q *Queue) Run(ctx context.Context) error {
	q.mu.Lock()
	if q.running || q.stopped {
		q.mu.Unlock()
		return errors.New("prefetch queue: Run called twice")
	}
	q.running = true
	q.mu.Unlock()

	if r := q.cfg.registerer; r != nil {
		for i, c := range q.metrics.collectors() {
			if err := r.Register(c); err != nil {
				for _, c := range q.metrics.collectors()[:i] {
					r.Unregister(c)
				}
				return fmt.Errorf("registering prefetch metrics: %w", err)
			}
		}
		defer func() {
			for _, c := range q.metrics.collectors() {
				r.Unregister(c)
			}
		}()
	}

	var wg sync.WaitGroup
	for range q.cfg.jobs {
		wg.Go(func() { q.work(ctx) })
	}
	<-ctx.Done()
	wg.Wait()

	q.mu.Lock()
	q.stopped = true
	pending := q.pending
	q.pending = nil
	q.mu.Unlock()
	for _, j := range pending {
		q.finish(j, "", ErrQueueStopped)
	}
	return nil
}

// Submit parses ref and queues a job for it, or returns the unfinished job
// already queued or running for the same canonical reference. A reference
// that does not parse is an error at once. A finished job is never returned:
// submitting again after a failure starts a new job.
func (q *Queue) Submit(ref string) (*Job, error) {
	r, err := ParseRef(ref)
	if err != nil {
		return nil, err
	}
	key := r.String()
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.stopped {
		return nil, ErrQueueStopped
	}
	if j, ok := q.active[key]; ok {
		return j, nil
	}
	j := newJob(newID(), r, time.Now())
	q.active[key] = j
	q.jobs[j.id] = j
	q.pending = append(q.pending, j)
	q.metrics.depth.Set(float64(len(q.pending)))
	select {
	case q.wake <- struct{}{}:
	default:
	}
	q.cfg.logger.Info("prefetch job queued", "job", j.id, "ref", r.Redacted())
	return j, nil
}

// Job returns the job with the given ID, if it is unfinished or among the
// recently finished ones the queue remembers.
func (q *Queue) Job(id string) (*Job, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	j, ok := q.jobs[id]
	return j, ok
}

// Jobs returns the status of every job the queue knows, oldest first.
func (q *Queue) Jobs() []JobStatus {
	q.mu.Lock()
	jobs := make([]*Job, 0, len(q.jobs))
	for _, j := range q.jobs {
		jobs = append(jobs, j)
	}
	q.mu.Unlock()
	out := make([]JobStatus, len(jobs))
	for i, j := range jobs {
		out[i] = j.Status()
	}
	slices.SortFunc(out, func(a, b JobStatus) int {
		return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.ID, b.ID))
	})
	return out
}

// work runs queued jobs one after another until ctx ends.
func (q *Queue) work(ctx context.Context) {
	for {
		j := q.next(ctx)
		if j == nil {
			return
		}
		dir, err := q.run(ctx, j)
		q.finish(j, dir, err)
	}
}

// next takes the oldest queued job, waiting for one; nil once ctx ends.
func (q *Queue) next(ctx context.Context) *Job {
	for {
		if ctx.Err() != nil {
			return nil
		}
		q.mu.Lock()
		if len(q.pending) > 0 {
			j := q.pending[0]
			q.pending[0] = nil
			q.pending = q.pending[1:]
			q.metrics.depth.Set(float64(len(q.pending)))
			if len(q.pending) > 0 {
				select { // pass the wake-up on to another worker
				case q.wake <- struct{}{}:
				default:
				}
			}
			q.mu.Unlock()
			return j
		}
		q.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-q.wake:
		}
	}
}

// run resolves, fetches and materialises one job's model.
func (q *Queue) run(ctx context.Context, j *Job) (string, error) {
	j.setState(StateResolving, time.Now())
	q.cfg.logger.Info("prefetch job started", "job", j.id, "ref", j.ref.Redacted())

	res, err := q.resolve(ctx, j.ref)
	if err != nil {
		return "", err
	}
	if err := res.Model.Validate(); err != nil {
		return "", fmt.Errorf("resolving %s: %w", j.ref.Redacted(), err)
	}
	// One fetch per distinct blob, largest first, named by its first file.
	type blob struct {
		cache.Descriptor
		path string
		src  cache.RangeOpener
	}
	var blobs []blob
	seen := make(map[digest.Digest]bool, len(res.Model.Files))
	for _, f := range res.Model.Files {
		if seen[f.Digest] {
			continue
		}
		seen[f.Digest] = true
		src := res.Blobs[f.Digest]
		if src == nil {
			return "", fmt.Errorf("resolving %s: no source for file %q (%s)", j.ref.Redacted(), f.Path, f.Digest)
		}
		blobs = append(blobs, blob{f.Descriptor, f.Path, src})
	}
	slices.SortStableFunc(blobs, func(a, b blob) int { return cmp.Compare(b.Size, a.Size) })
	j.plan(res.Model)
	for _, b := range blobs {
		defer q.store.Hold(b.Digest)()
	}

	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(q.cfg.files)
	for _, b := range blobs {
		g.Go(func() error {
			_, err := q.store.Fetch(gctx, b.Descriptor, b.src, func(done, _ int64) { j.progress(b.Digest, done) })
			if err != nil {
				return fmt.Errorf("fetching %s (%s): %w", b.path, b.Digest, err)
			}
			j.blobDone(b.Digest, b.Size)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return "", err
	}
	dir, err := q.store.Materialize(res.Model)
	if err != nil {
		return "", fmt.Errorf("materialising %s@%s: %w", res.Model.Name, res.Model.Revision, err)
	}
	return dir, nil
}

// resolve asks the source, retrying errors that are not permanent.
func (q *Queue) resolve(ctx context.Context, ref Ref) (*Resolution, error) {
	backoff := q.cfg.resolveBackoff
	for attempt := 1; ; attempt++ {
		res, err := q.src.Resolve(ctx, ref)
		if err == nil {
			return res, nil
		}
		if attempt >= q.cfg.resolveAttempts || errors.Is(err, cache.ErrPermanent) || ctx.Err() != nil {
			return nil, err
		}
		q.cfg.logger.Warn("resolving failed, retrying", "ref", ref.Redacted(), "attempt", attempt, "in", backoff, "err", err)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
		backoff *= 2
	}
}

// finish forgets j as the active job of its reference, remembers it among
// the finished ones, and finishes it.
func (q *Queue) finish(j *Job, dir string, err error) {
	q.mu.Lock()
	key := j.ref.String()
	if q.active[key] == j {
		delete(q.active, key)
	}
	q.finished = append(q.finished, j)
	for len(q.finished) > q.cfg.history {
		delete(q.jobs, q.finished[0].id)
		q.finished[0] = nil
		q.finished = q.finished[1:]
	}
	q.mu.Unlock()

	// Metrics first: whoever sees the job done sees it counted.
	now, outcome := time.Now(), string(StateReady)
	if err != nil {
		outcome = string(StateFailed)
	}
	q.metrics.jobs.WithLabelValues(outcome).Inc()
	q.metrics.seconds.WithLabelValues(outcome).Observe(now.Sub(j.Status().Created).Seconds())
	st := j.finish(dir, err, now)
	if err != nil {
		q.cfg.logger.Warn("prefetch job failed", "job", j.id, "ref", st.Ref, "err", err)
		return
	}
	q.cfg.logger.Info("prefetch job ready", "job", j.id, "ref", st.Ref, "model", st.Model, "revision", st.Revision,
		"dir", dir, "bytes", st.BytesTotal, "files", st.FilesTotal, "seconds", st.Finished.Sub(st.Created).Seconds())
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// queueMetrics are the queue's Prometheus collectors.
type queueMetrics struct {
	jobs    *prometheus.CounterVec
	depth   prometheus.Gauge
	seconds *prometheus.HistogramVec
}

func newQueueMetrics() queueMetrics {
	m := queueMetrics{
		jobs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_prefetch_jobs_total",
			Help: "Prefetch jobs finished, by outcome (ready or failed).",
		}, []string{"outcome"}),
		depth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_prefetch_queue_depth",
			Help: "Prefetch jobs waiting for a worker.",
		}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "weightd_prefetch_job_seconds",
			Help:    "Time from submitting a prefetch job to its end (queueing included), by outcome.",
			Buckets: prometheus.ExponentialBuckets(0.25, 2, 16), // 0.25 s … ~2.3 h
		}, []string{"outcome"}),
	}
	for _, o := range []JobState{StateReady, StateFailed} {
		m.jobs.WithLabelValues(string(o))
	}
	return m
}

func (m queueMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.jobs, m.depth, m.seconds}
}
