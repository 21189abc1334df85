package prefetch

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
)

// JobState is where a job is in its life.
type JobState string

// Job states, in order; a job ends ready or failed.
const (
	StateQueued    JobState = "queued"
	StateResolving JobState = "resolving"
	StateFetching  JobState = "fetching"
	StateImporting JobState = "importing" // an image, into the container runtime
	StateReady     JobState = "ready"
	StateFailed    JobState = "failed"
)

// Finished reports whether the state is final (ready or failed).
func (s JobState) Finished() bool { return s == StateReady || s == StateFailed }

// JobStatus is a snapshot of a job, as served by the local API.
type JobStatus struct {
	ID       string   `json:"id"`
	Ref      string   `json:"ref"` // canonical, with any query redacted
	State    JobState `json:"state"`
	Priority Priority `json:"priority"`
	// Model and Revision are known once the reference is resolved.
	Model    string `json:"model,omitempty"`
	Revision string `json:"revision,omitempty"`
	// BytesDone and BytesTotal count distinct blobs (files with the same
	// digest are fetched once); BytesDone counts verified, durable bytes.
	BytesDone  int64 `json:"bytesDone"`
	BytesTotal int64 `json:"bytesTotal"`
	// BytesFromPeers is the part of BytesDone that peers sent.
	BytesFromPeers int64 `json:"bytesFromPeers,omitempty"`
	FilesDone      int   `json:"filesDone"`
	FilesTotal     int   `json:"filesTotal"`
	// Dir is the materialised model directory once the job is ready.
	Dir      string    `json:"dir,omitempty"`
	Error    string    `json:"error,omitempty"`
	Created  time.Time `json:"created"`
	Started  time.Time `json:"started,omitzero"`
	Finished time.Time `json:"finished,omitzero"`
}

// Job is one submitted reference on its way to a model directory. Its
// methods are safe for concurrent use.
type Job struct {
	id  string
	ref ref.Ref
	// namespace is the requester's, "" for the operator (ForNamespace).
	namespace string

	mu       sync.Mutex
	st       JobStatus
	err      error
	blobs    map[digest.Digest]*blobProgress
	descs    []content.Descriptor
	watchers map[chan JobStatus]func() bool // → stop of the context.AfterFunc
	done     chan struct{}
	// stop cancels the running job; canceled records a Cancel that came
	// before the job started.
	stop     func()
	canceled bool
}

type blobProgress struct {
	done, peers int64
	files       int // files of the model that are this blob
}

func newJob(id string, r ref.Ref, p Priority, now time.Time) *Job {
	return &Job{
		id:       id,
		ref:      r,
		st:       JobStatus{ID: id, Ref: r.Redacted(), State: StateQueued, Priority: p, Created: now},
		watchers: make(map[chan JobStatus]func() bool),
		done:     make(chan struct{}),
	}
}

// ID returns the job's identifier, unique within its queue.
func (j *Job) ID() string { return j.id }

// Ref returns the reference the job fetches.
func (j *Job) Ref() ref.Ref { return j.ref }

// Status returns a snapshot of the job.
func (j *Job) Status() JobStatus {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.st
}

// Blobs lists the distinct blobs the job fetches (model files, packed
// layers, image blobs), largest first; empty until the reference is
// resolved. Files unpacked from packed layers are not among them. Policies
// pin them.
func (j *Job) Blobs() []content.Descriptor {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.descs)
}

// Done returns a channel closed when the job has finished, ready or failed.
func (j *Job) Done() <-chan struct{} { return j.done }

// Wait waits for the job to finish and returns its final status, and the
// error it failed with, if it failed. If ctx ends first it returns the status
// of the moment and ctx's error.
func (j *Job) Wait(ctx context.Context) (JobStatus, error) {
	select {
	case <-j.done:
	case <-ctx.Done():
		return j.Status(), ctx.Err()
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.st, j.err
}

// Watch streams the job's status: the current status at once, then updates
// as the job progresses. A watcher that does not keep up misses intermediate
// updates (it always receives the latest one when it reads), but the final
// status is always delivered, after which the channel is closed. When ctx
// ends first the channel is closed early.
func (j *Job) Watch(ctx context.Context) <-chan JobStatus {
	ch := make(chan JobStatus, 1)
	j.mu.Lock()
	defer j.mu.Unlock()
	ch <- j.st
	if j.st.State.Finished() {
		close(ch)
		return ch
	}
	j.watchers[ch] = context.AfterFunc(ctx, func() {
		j.mu.Lock()
		defer j.mu.Unlock()
		if _, ok := j.watchers[ch]; ok {
			delete(j.watchers, ch)
			close(ch)
		}
	})
	return ch
}

// notify hands the current status to every watcher without blocking: a
// stale update still waiting in a watcher's buffer is replaced. j.mu is held.
func (j *Job) notify() {
	for ch := range j.watchers {
		offer(ch, j.st)
	}
}

// offer puts st in ch (capacity 1), replacing what is there. Only one
// goroutine at a time may send on ch, so the second send cannot block.
func offer(ch chan JobStatus, st JobStatus) {
	select {
	case ch <- st:
		return
	default:
	}
	select {
	case <-ch:
	default:
	}
	ch <- st
}

func (j *Job) setState(s JobState, now time.Time) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.st.State = s
	if s == StateResolving {
		j.st.Started = now
	}
	j.notify()
}

// raise lifts a queued job's priority to p; it reports whether it did.
func (j *Job) raise(p Priority) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if p <= j.st.Priority {
		return false
	}
	j.st.Priority = p
	j.notify()
	return true
}

// start records how to cancel the job now that it runs. It returns false if
// the job was cancelled before it started.
func (j *Job) start(stop func()) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.stop = stop
	return !j.canceled
}

// cancel cancels the running job, or makes start fail if it has not started.
func (j *Job) cancel() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.canceled = true
	if j.stop != nil {
		j.stop()
	}
}

// plan records what the job will fetch and moves it to fetching.
func (j *Job) plan(name, revision string, blobs []fetchBlob) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.blobs = make(map[digest.Digest]*blobProgress, len(blobs))
	j.st.Model, j.st.Revision = name, revision
	// A job resolved again (source.ErrUnverified) plans anew.
	j.descs = j.descs[:0]
	j.st.BytesTotal, j.st.BytesDone, j.st.BytesFromPeers, j.st.FilesTotal, j.st.FilesDone = 0, 0, 0, 0, 0
	for _, b := range blobs {
		j.descs = append(j.descs, b.Descriptor)
		j.blobs[b.Digest] = &blobProgress{files: b.files}
		j.st.BytesTotal += b.Size
		j.st.FilesTotal += b.files
	}
	j.st.State = StateFetching
	j.notify()
}

// progress records that done bytes of blob d are verified, peers of them
// from peers. It is called from the cache's download goroutine and does not
// block.
func (j *Job) progress(d digest.Digest, done, peers int64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	b := j.blobs[d]
	if b == nil || done <= b.done {
		return
	}
	j.st.BytesDone += done - b.done
	j.st.BytesFromPeers += peers - b.peers
	b.done, b.peers = done, peers
	j.notify()
}

// blobDone records that blob d of size bytes is complete in the cache.
func (j *Job) blobDone(d digest.Digest, size int64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	b := j.blobs[d]
	j.st.BytesDone += size - b.done
	b.done = size
	j.st.FilesDone += b.files
	j.notify()
}

// finish records the outcome, delivers it to every watcher and closes their
// channels and Done.
func (j *Job) finish(dir string, err error, now time.Time) JobStatus {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.st.Finished = now
	if err != nil {
		j.st.State = StateFailed
		j.st.Error = err.Error()
		j.err = err
	} else {
		j.st.State = StateReady
		j.st.Dir = dir
	}
	for ch, stop := range j.watchers {
		stop()
		offer(ch, j.st)
		close(ch)
	}
	j.watchers = nil
	close(j.done)
	return j.st
}
