package prefetch

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

// Store is what the queue needs of the cache; *cache.Store provides it.
type Store interface {
	// Fetch makes the blob present, downloading it from src if needed.
	Fetch(ctx context.Context, desc content.Descriptor, src content.RangeOpener, progress content.Progress) (cache.Info, error)
	// Materialize lays out a model whose blobs are all present and returns
	// its directory.
	Materialize(m content.Model) (string, error)
	// Hold keeps a blob from eviction, present or not yet, until released:
	// a model's first files must survive while its last ones download.
	Hold(d digest.Digest) (release func())
	// Open opens a complete blob: a packed layer to unpack.
	Open(d digest.Digest) (*os.File, error)
	// Put stores content whose digest is known only once it is read: the
	// files unpacked from a packed layer. size is the size the content
	// declares (a tar entry's), negative for none; what Put writes is
	// bounded by it and by what the store can hold.
	Put(ctx context.Context, r io.Reader, size int64) (cache.Info, error)
}

// Importer puts an image whose blobs are all in the store where the
// container runtime finds it (pkg/containerd implements it). Errors not
// wrapped with content.Permanent are retried.
type Importer interface {
	Import(ctx context.Context, img *source.Image) error
}

// StreamingImporter is an Importer that can take an image's blobs one by
// one as they land in the store, so that importing overlaps fetching. The
// queue uses it when the importer implements it.
type StreamingImporter interface {
	Importer
	// Begin starts importing img, none of whose blobs need be in the store
	// yet. Its errors are Import's.
	Begin(ctx context.Context, img *source.Image) (ImageImport, error)
}

// ImageImport is one image's import under way (StreamingImporter.Begin).
// Its methods are safe for concurrent use.
type ImageImport interface {
	// Blob says blob d of the image is complete in the store. It does not
	// wait for what the import does with it (or waits a bounded time); it
	// returns the import's first failure, if any.
	Blob(ctx context.Context, d digest.Digest) error
	// Commit finishes the import once every blob is in the store (those not
	// handed over with Blob are taken from the store now) and ends it. On
	// error the image is not imported and nothing is held.
	Commit(ctx context.Context) error
	// Abort ends the import without importing the image, releasing what it
	// holds. It does nothing once the import has ended.
	Abort()
}

// Errors of jobs that did not run to their end.
var (
	// ErrQueueStopped is returned by Submit once the queue's Run has
	// returned, and is the error of jobs still queued then.
	ErrQueueStopped = errors.New("prefetch queue stopped")
	// ErrCanceled is the error of a job cancelled with Queue.Cancel.
	ErrCanceled = errors.New("prefetch job canceled")
)

// Queue defaults.
const (
	DefaultJobConcurrency  = 2
	DefaultFileConcurrency = 4
	DefaultHistory         = 1000
	DefaultResolveAttempts = 3
	DefaultResolveBackoff  = time.Second
	DefaultModelLabels     = 50
)

// Queue runs prefetch jobs: resolve a reference, fetch its files into the
// store, materialise the model. Submit may be called before and while Run
// runs; its methods are safe for concurrent use.
type Queue struct {
	store   Store
	src     source.Source
	cfg     queueConfig
	metrics queueMetrics

	mu       sync.Mutex
	running  bool
	stopped  bool
	pending  []*Job          // by priority, then FIFO
	active   map[string]*Job // canonical ref → unfinished job
	jobs     map[string]*Job // ID → unfinished or remembered job
	finished []*Job          // remembered finished jobs, oldest first
	wake     chan struct{}   // capacity 1: pending is not empty

	// runningIn counts the running jobs of each namespace ("" for the
	// operator's), for next to share the job slots out.
	runningIn map[string]int
}

// NewQueue returns a queue that fetches into store what src resolves. It
// starts nothing: call Run.
func NewQueue(store Store, src source.Source, opts ...QueueOption) *Queue {
	cfg := queueConfig{
		jobs:            DefaultJobConcurrency,
		files:           DefaultFileConcurrency,
		history:         DefaultHistory,
		resolveAttempts: DefaultResolveAttempts,
		resolveBackoff:  DefaultResolveBackoff,
		logger:          slog.New(slog.DiscardHandler),
		tracer:          noop.NewTracerProvider().Tracer(TracerName),
		modelLabels:     DefaultModelLabels,
	}
	for _, o := range opts {
		o(&cfg)
	}
	return &Queue{
		store:   store,
		src:     src,
		cfg:     cfg,
		metrics: newQueueMetrics(cfg.modelLabels),
		active:  make(map[string]*Job),
		jobs:    make(map[string]*Job),
		wake:    make(chan struct{}, 1),

		runningIn: make(map[string]int),
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
		q.finish(j, "", ErrQueueStopped, nil)
	}
	return nil
}

// SubmitOption qualifies a submitted job.
type SubmitOption func(*submitConfig)

type submitConfig struct {
	namespace string
}

// ForNamespace submits the job on behalf of a pod of namespace ns: its
// sources use the agent's credentials only where the source.AgentCredentials they
// were given allow ns (see source.WithRequester), and namespaces take turns at the
// job slots. Without it the job is the operator's.
func ForNamespace(ns string) SubmitOption {
	return func(c *submitConfig) { c.namespace = ns }
}

// Submit parses reference and queues a job for it at priority p, or returns
// the unfinished job already queued or running for the same canonical
// reference and requester (raising its priority to p if it is still queued
// at a lower one). A reference that does not parse is an error at once,
// wrapping ref.ErrInvalid. A finished job is never returned: submitting
// again after a failure starts a new job.
func (q *Queue) Submit(reference string, p Priority, opts ...SubmitOption) (*Job, error) {
	r, err := ref.Parse(reference)
	if err != nil {
		return nil, err
	}
	var sc submitConfig
	for _, o := range opts {
		o(&sc)
	}
	// Jobs of different requesters are not shared: one may be allowed the
	// agent's credentials and the other not.
	key := jobKey(r, sc.namespace)
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.stopped {
		return nil, ErrQueueStopped
	}
	if j, ok := q.active[key]; ok {
		if i := slices.Index(q.pending, j); i >= 0 && j.raise(p) {
			q.pending = slices.Delete(q.pending, i, i+1)
			q.enqueue(j)
		}
		return j, nil
	}
	j := newJob(newID(), r, p, time.Now())
	j.namespace = sc.namespace
	q.active[key] = j
	q.jobs[j.id] = j
	q.enqueue(j)
	q.metrics.depth.Set(float64(len(q.pending)))
	select {
	case q.wake <- struct{}{}:
	default:
	}
	q.cfg.logger.Info("prefetch job queued", "job", j.id, "ref", r.Redacted(), "priority", p)
	return j, nil
}

// enqueue inserts j after every pending job of its priority or higher.
// q.mu is held.
func (q *Queue) enqueue(j *Job) {
	p := j.Status().Priority
	i := len(q.pending)
	for i > 0 && q.pending[i-1].Status().Priority < p {
		i--
	}
	q.pending = slices.Insert(q.pending, i, j)
}

// Cancel stops the job with the given ID: a queued job fails at once with
// ErrCanceled, a running one as soon as its downloads notice (what they
// verified stays in the cache for a later request). Cancelling a finished
// job changes nothing. It reports whether the queue knows the job.
func (q *Queue) Cancel(id string) bool {
	q.mu.Lock()
	j, ok := q.jobs[id]
	if !ok {
		q.mu.Unlock()
		return false
	}
	i := slices.Index(q.pending, j)
	if i >= 0 {
		q.pending = slices.Delete(q.pending, i, i+1)
		q.metrics.depth.Set(float64(len(q.pending)))
	}
	q.mu.Unlock()
	if i >= 0 {
		q.finish(j, "", ErrCanceled, nil)
		return true
	}
	j.cancel()
	return true
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
		jctx, cancel := context.WithCancelCause(ctx)
		if !j.start(func() { cancel(ErrCanceled) }) {
			cancel(nil)
			q.finish(j, "", ErrCanceled, nil) // cancelled while being taken
			q.ended(j)
			continue
		}
		sctx, span := q.startJobSpan(source.WithRequester(jctx, j.namespace), j)
		dir, err := q.run(sctx, j)
		if errors.Is(err, source.ErrUnverified) && jctx.Err() == nil {
			// The source no longer gives what failed: resolve anew.
			q.cfg.logger.Warn("resolution did not match its content; resolving again", "job", j.id, "ref", j.ref.Redacted(), "err", err)
			dir, err = q.run(sctx, j)
		}
		if context.Cause(jctx) == ErrCanceled {
			err = ErrCanceled
		}
		cancel(nil)
		q.finish(j, dir, err, span)
		q.ended(j)
	}
}

// ended takes j, which next handed out, off its namespace's running jobs.
func (q *Queue) ended(j *Job) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.runningIn[j.namespace]--; q.runningIn[j.namespace] <= 0 {
		delete(q.runningIn, j.namespace)
	}
}

// next takes the queued job to run next, waiting for one; nil once ctx
// ends. That is the oldest of the highest priority queued whose namespace
// runs the fewest jobs: at equal priority namespaces take turns, so that one
// that queued many slow jobs first cannot hold every slot while another's
// wait.
func (q *Queue) next(ctx context.Context) *Job {
	for {
		if ctx.Err() != nil {
			return nil
		}
		q.mu.Lock()
		if len(q.pending) > 0 {
			i := q.fairest()
			j := q.pending[i]
			q.pending = slices.Delete(q.pending, i, i+1)
			q.runningIn[j.namespace]++
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

// fairest is the index in pending of the job next takes. q.mu is held.
func (q *Queue) fairest() int {
	top := q.pending[0].Status().Priority
	best := 0
	for i, j := range q.pending {
		if q.runningIn[q.pending[best].namespace] == 0 || j.Status().Priority != top {
			break
		}
		if q.runningIn[j.namespace] < q.runningIn[q.pending[best].namespace] {
			best = i
		}
	}
	return best
}

// finish forgets j as the active job of its reference, remembers it among
// the finished ones, ends its span (nil for a job that never ran) and
// finishes it.
func (q *Queue) finish(j *Job, dir string, err error, span trace.Span) {
	q.mu.Lock()
	key := jobKey(j.ref, j.namespace)
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
	now, outcome, before := time.Now(), outcomeOf(err), j.Status()
	took := now.Sub(before.Created).Seconds()
	q.metrics.jobs.WithLabelValues(string(j.ref.Kind), outcome).Inc()
	q.metrics.seconds.WithLabelValues(string(j.ref.Kind), outcome).Observe(took)
	if err == nil {
		q.metrics.ready.WithLabelValues(q.metrics.models.Label(before.Model)).Observe(took)
	}
	if span != nil { // before the job is seen done: its trace is complete then
		endJobSpan(span, before, err)
	}
	st := j.finish(dir, err, now)
	if err != nil {
		q.cfg.logger.Warn("prefetch job failed", "job", j.id, "ref", st.Ref, "err", err)
		return
	}
	q.cfg.logger.Info("prefetch job ready", "job", j.id, "ref", st.Ref, "model", st.Model, "revision", st.Revision,
		"dir", dir, "bytes", st.BytesTotal, "files", st.FilesTotal, "seconds", st.Finished.Sub(st.Created).Seconds())
}

// jobKey is what jobs are shared by: the canonical reference and the
// requester's namespace ("" for the operator).
func jobKey(r ref.Ref, namespace string) string {
	return r.String() + "\x00" + namespace
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// outcomeOf is a finished job's outcome label: ready, failed or canceled.
func outcomeOf(err error) string {
	switch {
	case err == nil:
		return string(StateReady)
	case errors.Is(err, ErrCanceled):
		return "canceled"
	}
	return string(StateFailed)
}

// queueMetrics are the queue's Prometheus collectors.
type queueMetrics struct {
	jobs    *prometheus.CounterVec
	depth   prometheus.Gauge
	seconds *prometheus.HistogramVec
	ready   *prometheus.HistogramVec
	models  *LabelLimiter // of ready's model label
}

func newQueueMetrics(modelLabels int) queueMetrics {
	m := queueMetrics{
		jobs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_prefetch_jobs_total",
			Help: "Prefetch jobs finished, by source kind (http, oci, hf) and outcome (ready, failed, canceled).",
		}, []string{"kind", "outcome"}),
		depth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_prefetch_queue_depth",
			Help: "Prefetch jobs waiting for a worker.",
		}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "weightd_prefetch_job_seconds",
			Help:    "Time from submitting a prefetch job to its end (queueing included), by source kind and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.25, 2, 16), // 0.25 s … ~2.3 h
		}, []string{"kind", "outcome"}),
		ready: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "weightd_prefetch_ready_seconds",
			Help: "Time from submitting a prefetch job to its model or image being ready (queueing included), by model " +
				"(org/name, no revision; the first models seen keep their name, later ones are \"other\").",
			Buckets: prometheus.ExponentialBuckets(0.25, 2, 16), // as weightd_prefetch_job_seconds
		}, []string{"model"}),
		models: NewLabelLimiter(modelLabels),
	}
	for _, k := range []ref.Kind{ref.KindHTTP, ref.KindOCI, ref.KindHF, ref.KindS3} {
		for _, o := range []string{string(StateReady), string(StateFailed), "canceled"} {
			m.jobs.WithLabelValues(string(k), o)
		}
	}
	return m
}

func (m queueMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.jobs, m.depth, m.seconds, m.ready}
}

func truncate(s string) string {
	if len(s) > 120 {
		return s[:120] + "…"
	}
	return s
}
