package cache

import (
	"context"
	"crypto/sha256"
	"encoding"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"
)

const (
	pieceSize = 1 << 20 // the unit passed down the ingest pipeline
	pieces    = 16      // pieces in flight: bounds the memory of one download
)

type hashState interface {
	hash.Hash
	encoding.BinaryMarshaler
	encoding.BinaryUnmarshaler
}

// flight is one download of one blob, shared by every caller that asks for
// the blob while it runs.
type flight struct {
	desc     Descriptor
	started  time.Time
	done     atomic.Int64
	finished chan struct{}
	after    <-chan struct{} // an abandoned flight of the same blob still winding down
	cancel   context.CancelFunc

	// guarded by Store.mu
	waiters   int
	abandoned bool

	subsMu sync.Mutex
	subs   map[int]Progress
	nextID int

	info Info // set before finished is closed
	err  error
}

func (f *flight) subscribe(p Progress) int {
	f.subsMu.Lock()
	defer f.subsMu.Unlock()
	f.nextID++
	if p != nil {
		f.subs[f.nextID] = p
		p(f.done.Load(), f.desc.Size)
	}
	return f.nextID
}

func (f *flight) unsubscribe(id int) {
	f.subsMu.Lock()
	delete(f.subs, id)
	f.subsMu.Unlock()
}

func (f *flight) report(done int64) {
	f.done.Store(done)
	f.subsMu.Lock()
	for _, p := range f.subs {
		p(done, f.desc.Size)
	}
	f.subsMu.Unlock()
}

// Fetch makes the blob desc present in the store and returns its Info. A blob
// already present is a hit and returns at once. Otherwise it is downloaded
// from src: ranges are retried and resumed from the last byte received, the
// bytes are hashed as they arrive, and the blob becomes visible only after
// its size and sha256 match desc. Concurrent Fetches of one blob share one
// download (the first caller's src is used); the download stops when every
// caller has gone, keeping its progress for the next Fetch.
func (s *Store) Fetch(ctx context.Context, desc Descriptor, src RangeOpener, progress Progress) (Info, error) {
	if err := desc.Validate(); err != nil {
		return Info{}, err
	}
	d := desc.Digest
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return Info{}, ErrClosed
	}
	if r, ok := s.blobs[d]; ok {
		s.mu.Unlock()
		if r.Size != desc.Size {
			return Info{}, fmt.Errorf("blob %s is %d bytes, not %d: %w", d, r.Size, desc.Size, ErrSizeMismatch)
		}
		s.m.hits.Inc()
		s.touch(d)
		if progress != nil {
			progress(desc.Size, desc.Size)
		}
		return s.Stat(d)
	}
	f := s.flights[d]
	if f != nil && f.desc.Size != desc.Size {
		s.mu.Unlock()
		return Info{}, fmt.Errorf("blob %s is being fetched as %d bytes, not %d: %w", d, f.desc.Size, desc.Size, ErrSizeMismatch)
	}
	if f == nil || f.abandoned {
		next := s.startFlight(desc, src)
		if f != nil {
			next.after = f.finished
		}
		f = next
	} else {
		s.log.Debug("joining download in flight", "digest", d, "heldFor", time.Since(f.started))
	}
	f.waiters++
	s.mu.Unlock()

	id := f.subscribe(progress)
	defer f.unsubscribe(id)
	select {
	case <-f.finished:
		return f.info, f.err
	case <-ctx.Done():
		s.mu.Lock()
		f.waiters--
		if f.waiters == 0 {
			f.abandoned = true
			f.cancel()
		}
		s.mu.Unlock()
		return Info{}, fmt.Errorf("fetching blob %s: %w", d, ctx.Err())
	}
}

// startFlight registers and starts a download; s.mu must be held.
func (s *Store) startFlight(desc Descriptor, src RangeOpener) *flight {
	ctx, cancel := context.WithCancel(s.ctx)
	f := &flight{
		desc: desc, started: time.Now(), finished: make(chan struct{}),
		cancel: cancel, subs: make(map[int]Progress),
	}
	s.flights[desc.Digest] = f
	s.m.misses.Inc()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer cancel()
		if f.after != nil {
			select {
			case <-f.after:
			case <-ctx.Done():
			}
		}
		info, err := s.download(ctx, f, src)
		if err != nil {
			err = fmt.Errorf("fetching blob %s: %w", desc.Digest, err)
		}
		s.mu.Lock()
		f.info, f.err = info, err
		if s.flights[desc.Digest] == f {
			delete(s.flights, desc.Digest)
		}
		s.mu.Unlock()
		close(f.finished)
	}()
	return f
}

// download runs one flight: reserve and allocate space, resume or start the
// partial file, stream, verify and commit.
func (s *Store) download(ctx context.Context, f *flight, src RangeOpener) (Info, error) {
	if err := ctx.Err(); err != nil {
		return Info{}, err
	}
	desc := f.desc
	start := time.Now()
	file, err := s.reserve(desc)
	if err != nil {
		if errors.Is(err, ErrDiskFull) {
			s.m.diskFull.Inc()
		}
		return Info{}, err
	}
	defer file.Close()
	st, whole := s.resumeState(file, desc)
	if st.Verified > 0 {
		s.log.Info("resuming download", "digest", desc.Digest, "from", st.Verified, "size", desc.Size)
	}
	f.report(st.Verified)

	err = s.transfer(ctx, f, src, file, st, whole)
	if err == nil {
		var info Info
		info, err = s.commit(file, st)
		if err == nil {
			s.m.ingestSeconds.Observe(time.Since(start).Seconds())
			s.log.Info("blob stored", "digest", desc.Digest, "size", desc.Size, "seconds", time.Since(start).Seconds())
			return info, nil
		}
	}
	switch {
	case errors.Is(err, ErrDigestMismatch), errors.Is(err, ErrSizeMismatch):
		s.m.verificationFailures.Inc()
		s.dropPartial(desc, false)
	case errors.Is(err, ErrDiskFull):
		s.m.diskFull.Inc()
		s.dropPartial(desc, false)
	default:
		// Keep what was verified for a later resume; it stays evictable.
		s.dropPartial(desc, true)
	}
	return Info{}, err
}

// dropPartial releases a download's reservation and either keeps its files
// as an idle partial or deletes them.
func (s *Store) dropPartial(desc Descriptor, keep bool) {
	if !keep {
		s.removePartial(desc.Digest)
	}
	s.mu.Lock()
	s.reserved -= desc.Size
	if keep {
		s.partials[desc.Digest] = desc.Size
	}
	s.mu.Unlock()
	s.updateGauges()
}

// resumeState loads and checks the saved progress of a download, or starts
// from zero.
func (s *Store) resumeState(file *os.File, desc Descriptor) (*partialState, hashState) {
	if st := s.readState(desc); st != nil {
		whole, err := verifyResume(file, st)
		if err == nil {
			return st, whole
		}
		s.log.Warn("partial download failed verification; starting over", "digest", desc.Digest, "err", err)
	}
	return &partialState{
		Version: partialStateVersion, Digest: desc.Digest, Size: desc.Size, ChunkSize: s.opts.chunkSize,
	}, sha256.New().(hashState)
}

// piece is a slice of the blob travelling down the pipeline: the reader fills
// it, the hasher and the writer each consume it, the last one recycles it.
type piece struct {
	off     int64
	buf     []byte
	n       int
	pending atomic.Int32
}

// chunkDone carries one stage's result for a finished chunk to the committer.
type chunkDone struct {
	index int64
	data  []byte // the chunk's sha256 (writer) or the whole-blob hash state after it (hasher)
}

// transfer streams [st.Verified, size) from src into file through three
// concurrent stages: read (with retries), hash the whole blob, and write plus
// hash each chunk. The committer records a chunk once both stages are done
// with it and checkpoints the progress every checkpoint interval.
func (s *Store) transfer(ctx context.Context, f *flight, src RangeOpener, file *os.File, st *partialState, whole hashState) error {
	desc := f.desc
	if st.Verified == desc.Size {
		st.HashState = mustMarshal(whole)
		return nil
	}
	g, ctx := errgroup.WithContext(ctx)
	free := make(chan *piece, pieces)
	for range pieces {
		free <- &piece{buf: make([]byte, pieceSize)}
	}
	toHash := make(chan *piece, pieces)
	toWrite := make(chan *piece, pieces)
	hashed := make(chan chunkDone, 4)
	written := make(chan chunkDone, 4)
	recycle := func(p *piece) {
		if p.pending.Add(-1) == 0 {
			free <- p
		}
	}
	chunkEnd := func(off int64) int64 { return min((off/st.ChunkSize+1)*st.ChunkSize, desc.Size) }

	g.Go(func() error {
		defer close(toHash)
		defer close(toWrite)
		return s.read(ctx, src, desc, st.Verified, chunkEnd, free, func(p *piece) error {
			p.pending.Store(2)
			for _, out := range []chan *piece{toHash, toWrite} {
				select {
				case out <- p:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return nil
		})
	})
	g.Go(func() error {
		for p := range toHash {
			whole.Write(p.buf[:p.n])
			end := p.off + int64(p.n)
			if end == chunkEnd(p.off) {
				select {
				case hashed <- chunkDone{index: p.off / st.ChunkSize, data: mustMarshal(whole)}:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			recycle(p)
		}
		return nil
	})
	g.Go(func() error {
		c := sha256.New()
		for p := range toWrite {
			if _, err := file.WriteAt(p.buf[:p.n], p.off); err != nil {
				return fmt.Errorf("writing %s: %w", file.Name(), diskErr(err))
			}
			c.Write(p.buf[:p.n])
			end := p.off + int64(p.n)
			f.report(end)
			if end == chunkEnd(p.off) {
				select {
				case written <- chunkDone{index: p.off / st.ChunkSize, data: c.Sum(nil)}:
				case <-ctx.Done():
					return ctx.Err()
				}
				c.Reset()
			}
			recycle(p)
		}
		return nil
	})
	// The committer owns st: it only ever describes chunks both stages finished.
	var cpErr error
	g.Go(func() error {
		last := time.Now()
		for st.Verified < desc.Size {
			var h, w chunkDone
			for _, ch := range []chan chunkDone{hashed, written} {
				select {
				case r := <-ch:
					if ch == hashed {
						h = r
					} else {
						w = r
					}
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			if h.index != w.index || h.index*st.ChunkSize != st.Verified {
				return fmt.Errorf("internal error: chunk %d/%d out of order at byte %d", h.index, w.index, st.Verified)
			}
			st.Chunks = append(st.Chunks, w.data...)
			st.HashState = h.data
			st.Verified = chunkEnd(st.Verified)
			if st.Verified < desc.Size && time.Since(last) >= s.opts.checkpoint {
				if err := s.checkpoint(file, st); err != nil {
					cpErr = err
					return err
				}
				last = time.Now()
			}
		}
		return nil
	})
	err := g.Wait()
	if err != nil && cpErr == nil && st.Verified > 0 && st.Verified < desc.Size && !errors.Is(err, ErrDiskFull) {
		// Keep the progress made so far for the next attempt or run.
		if cerr := s.checkpoint(file, st); cerr != nil {
			s.log.Warn("saving download progress", "digest", desc.Digest, "err", cerr)
		}
	}
	return err
}

func (s *Store) checkpoint(file *os.File, st *partialState) error {
	if err := fdatasync(file); err != nil {
		return fmt.Errorf("syncing partial %s: %w", st.Digest, err)
	}
	if err := s.saveState(st); err != nil {
		return fmt.Errorf("saving progress of %s: %w", st.Digest, err)
	}
	return nil
}

// read pulls [from, size) from src into pieces that never straddle a chunk,
// handing each to emit. A failed or stalled request is retried from the next
// byte needed, with exponential backoff and jitter; attempts that make
// progress reset the count. Errors marked Permanent end it at once.
func (s *Store) read(ctx context.Context, src RangeOpener, desc Descriptor, from int64,
	chunkEnd func(int64) int64, free chan *piece, emit func(*piece) error) error {
	next := from
	failures := 0
	for next < desc.Size {
		before := next
		err := s.readAttempt(ctx, src, desc, &next, chunkEnd, free, emit)
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, ErrPermanent) {
			return err
		}
		if next > before {
			failures = 0
		}
		failures++
		if failures >= s.opts.attempts {
			return fmt.Errorf("giving up at byte %d of %d after %d attempts: %w", next, desc.Size, failures, err)
		}
		s.m.retries.Inc()
		wait := s.opts.backoff << (failures - 1)
		wait += time.Duration(rand.Int64N(int64(wait)/2 + 1))
		s.log.Warn("source failed; retrying", "digest", desc.Digest, "at", next, "in", wait, "err", err)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// readAttempt runs one request of src from *next, advancing *next as pieces
// are emitted. It returns nil once the whole blob has been read.
func (s *Store) readAttempt(ctx context.Context, src RangeOpener, desc Descriptor, next *int64,
	chunkEnd func(int64) int64, free chan *piece, emit func(*piece) error) error {
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	var stalled atomic.Bool
	timer := time.AfterFunc(s.opts.stallTimeout, func() { stalled.Store(true); cancel() })
	defer timer.Stop()

	body, err := src.OpenRange(actx, *next)
	if err != nil {
		return s.attemptErr(err, &stalled)
	}
	defer body.Close()
	r := &watchdogReader{r: body, timer: timer, d: s.opts.stallTimeout}
	for *next < desc.Size {
		timer.Stop() // waiting for a free piece is our own back-pressure, not a stall
		var p *piece
		select {
		case p = <-free:
		case <-ctx.Done():
			return ctx.Err()
		}
		timer.Reset(s.opts.stallTimeout)
		want := min(int64(pieceSize), chunkEnd(*next)-*next)
		n, err := io.ReadFull(r, p.buf[:want])
		if n > 0 {
			p.off, p.n = *next, n
			if eerr := emit(p); eerr != nil {
				return eerr
			}
			*next += int64(n)
			s.m.ingestBytes.Add(float64(n))
		} else {
			free <- p
		}
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				err = fmt.Errorf("source ended the stream at byte %d of %d", *next, desc.Size)
			}
			return s.attemptErr(err, &stalled)
		}
	}
	var one [1]byte
	if n, _ := r.Read(one[:]); n > 0 {
		return Permanent(fmt.Errorf("%w: source sent more than %d bytes", ErrSizeMismatch, desc.Size))
	}
	return nil
}

func (s *Store) attemptErr(err error, stalled *atomic.Bool) error {
	if stalled.Load() {
		return fmt.Errorf("source sent nothing for %v: %w", s.opts.stallTimeout, err)
	}
	return err
}

// watchdogReader pushes back the stall timer whenever bytes arrive.
type watchdogReader struct {
	r     io.Reader
	timer *time.Timer
	d     time.Duration
}

func (w *watchdogReader) Read(p []byte) (int, error) {
	n, err := w.r.Read(p)
	if n > 0 {
		w.timer.Reset(w.d)
	}
	return n, err
}

// commit checks the whole blob against its digest and makes it visible:
// fsync, read-only, rename into blobs/, fsync the directory, index it.
func (s *Store) commit(file *os.File, st *partialState) (Info, error) {
	h := sha256.New().(hashState)
	if err := h.UnmarshalBinary(st.HashState); err != nil {
		return Info{}, fmt.Errorf("restoring hash state: %w", err)
	}
	if got := digest.NewDigest(digest.SHA256, h); got != st.Digest {
		s.log.Warn("downloaded blob does not match its digest", "want", st.Digest, "got", got)
		return Info{}, fmt.Errorf("%w: got %s", ErrDigestMismatch, got)
	}
	if err := fdatasync(file); err != nil {
		return Info{}, fmt.Errorf("syncing %s: %w", file.Name(), err)
	}
	if err := file.Chmod(0o444); err != nil {
		return Info{}, err
	}
	dst, _ := s.BlobPath(st.Digest)
	if err := os.Rename(s.partialData(st.Digest), dst); err != nil {
		return Info{}, fmt.Errorf("committing blob %s: %w", st.Digest, err)
	}
	if err := syncDir(blobsDir(s.root)); err != nil {
		return Info{}, err
	}
	os.Remove(s.partialStatePath(st.Digest))
	rec := &record{Size: st.Size, LastAccess: time.Now(), ChunkSize: st.ChunkSize, Chunks: st.Chunks}
	if err := s.putBlob(st.Digest, rec); err != nil {
		// The blob is durable and verified; the next Open reconciles the index.
		s.log.Warn("indexing committed blob", "digest", st.Digest, "err", err)
	}
	s.mu.Lock()
	s.blobs[st.Digest] = rec
	s.reserved -= st.Size
	s.mu.Unlock()
	s.updateGauges()
	return rec.info(st.Digest), nil
}

func mustMarshal(h hashState) []byte {
	b, err := h.MarshalBinary()
	if err != nil {
		panic(err) // crypto/sha256 cannot fail to marshal
	}
	return b
}
