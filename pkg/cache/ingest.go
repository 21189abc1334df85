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

	"github.com/weightd/weightd/pkg/content"
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
	desc     content.Descriptor
	started  time.Time
	done     atomic.Int64
	peers    atomic.Int64 // of done, the bytes peers sent
	finished chan struct{}
	after    <-chan struct{} // an abandoned flight of the same blob still winding down
	cancel   context.CancelFunc

	// guarded by Store.mu
	waiters   int
	abandoned bool
	partial   *Partial // set once the data file is open

	subsMu sync.Mutex
	subs   map[int]content.Progress
	nextID int

	info Info // set before finished is closed
	err  error
}

func (f *flight) subscribe(p content.Progress) int {
	f.subsMu.Lock()
	defer f.subsMu.Unlock()
	f.nextID++
	if p != nil {
		f.subs[f.nextID] = p
		p(f.done.Load(), f.peers.Load(), f.desc.Size)
	}
	return f.nextID
}

func (f *flight) unsubscribe(id int) {
	f.subsMu.Lock()
	delete(f.subs, id)
	f.subsMu.Unlock()
}

func (f *flight) report(done, peers int64) {
	f.done.Store(done)
	f.peers.Store(peers)
	f.subsMu.Lock()
	for _, p := range f.subs {
		p(done, peers, f.desc.Size)
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
func (s *Store) Fetch(ctx context.Context, desc content.Descriptor, src content.RangeOpener, progress content.Progress) (Info, error) {
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
			return Info{}, fmt.Errorf("blob %s is %d bytes, not %d: %w", d, r.Size, desc.Size, content.ErrSizeMismatch)
		}
		s.m.hits.Inc()
		s.touch(d)
		if progress != nil {
			progress(desc.Size, 0, desc.Size)
		}
		return s.Stat(d)
	}
	f := s.flights[d]
	if f != nil && f.desc.Size != desc.Size {
		s.mu.Unlock()
		return Info{}, fmt.Errorf("blob %s is being fetched as %d bytes, not %d: %w", d, f.desc.Size, desc.Size, content.ErrSizeMismatch)
	}
	if f == nil || f.abandoned {
		var after <-chan struct{}
		if f != nil {
			after = f.finished
		}
		f = s.startFlight(desc, src, after)
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

// startFlight registers and starts a download, once after (an abandoned
// download of the same blob) has finished, if not nil; s.mu must be held.
func (s *Store) startFlight(desc content.Descriptor, src content.RangeOpener, after <-chan struct{}) *flight {
	ctx, cancel := context.WithCancel(s.ctx)
	f := &flight{
		desc: desc, started: time.Now(), finished: make(chan struct{}),
		cancel: cancel, subs: make(map[int]content.Progress), after: after,
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

// ChunkFiller is a source that fills a download chunk by chunk, in any
// order, from many places at once (the peer-to-peer swarm). When the source
// given to Fetch implements it, Fetch calls Fill instead of streaming.
type ChunkFiller interface {
	// Fill makes every chunk of p present (Partial.WriteChunk), or returns
	// an error. The store then verifies the whole blob and commits it.
	Fill(ctx context.Context, p *Partial) error
}

// download runs one flight: reserve and allocate space, resume or start the
// partial file, fill it (streaming or chunk by chunk), verify and commit.
func (s *Store) download(ctx context.Context, f *flight, src content.RangeOpener) (Info, error) {
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
	p := s.openPartial(f, file)
	f.report(p.Present(), 0)
	s.mu.Lock()
	f.partial = p
	s.mu.Unlock()
	s.emit(Event{Kind: EventPartial, Digest: desc.Digest})

	if filler, ok := src.(ChunkFiller); ok {
		err = filler.Fill(ctx, p)
		if err == nil {
			err = p.Verify()
		}
	} else {
		err = s.transfer(ctx, f, src, p)
	}
	if err == nil {
		var info Info
		info, err = s.commit(p)
		if err == nil {
			s.m.ingestSeconds.Observe(time.Since(start).Seconds())
			s.log.Info("blob stored", "digest", desc.Digest, "size", desc.Size, "seconds", time.Since(start).Seconds())
			s.emit(Event{Kind: EventComplete, Digest: desc.Digest})
			return info, nil
		}
	}
	s.emit(Event{Kind: EventRemoved, Digest: desc.Digest})
	switch {
	case errors.Is(err, content.ErrDigestMismatch), errors.Is(err, content.ErrSizeMismatch):
		s.m.verificationFailures.Inc()
		s.dropPartial(desc, false)
	case errors.Is(err, ErrDiskFull):
		s.m.diskFull.Inc()
		s.dropPartial(desc, false)
	default:
		// Keep what was verified for a later resume; it stays evictable.
		if p.Present() > 0 {
			if cerr := p.checkpoint(true); cerr != nil {
				s.log.Warn("saving download progress", "digest", desc.Digest, "err", cerr)
			}
		}
		s.dropPartial(desc, true)
	}
	return Info{}, err
}

// dropPartial releases a download's reservation and either keeps its files
// as an idle partial or deletes them.
func (s *Store) dropPartial(desc content.Descriptor, keep bool) {
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

// transfer streams the blob from src into p, from the end of its hashed
// prefix to the end, through three concurrent stages: read (with retries),
// hash the whole blob, and write plus hash each chunk. The committer marks a
// chunk present once both stages are done with it, so the chunk server can
// serve it at once, and checkpoints the progress every interval.
func (s *Store) transfer(ctx context.Context, f *flight, src content.RangeOpener, p *Partial) error {
	desc := f.desc
	p.mu.Lock()
	from := p.st.Hashed
	p.mu.Unlock()
	if from == desc.Size {
		return nil
	}
	whole := p.whole // the stream owns the hash: no advanceHash runs in this mode
	g, ctx := errgroup.WithContext(ctx)
	free := make(chan *piece, pieces)
	for range pieces {
		free <- &piece{buf: make([]byte, pieceSize)}
	}
	toHash := make(chan *piece, pieces)
	toWrite := make(chan *piece, pieces)
	hashed := make(chan chunkDone, 4)
	written := make(chan chunkDone, 4)
	recycle := func(pc *piece) {
		if pc.pending.Add(-1) == 0 {
			free <- pc
		}
	}
	cs := p.cs
	chunkEnd := func(off int64) int64 { return min((off/cs+1)*cs, desc.Size) }

	g.Go(func() error {
		defer close(toHash)
		defer close(toWrite)
		return s.read(ctx, src, desc, from, chunkEnd, free, func(pc *piece) error {
			pc.pending.Store(2)
			for _, out := range []chan *piece{toHash, toWrite} {
				select {
				case out <- pc:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return nil
		})
	})
	g.Go(func() error {
		for pc := range toHash {
			whole.Write(pc.buf[:pc.n])
			if end := pc.off + int64(pc.n); end == chunkEnd(pc.off) {
				select {
				case hashed <- chunkDone{index: pc.off / cs, data: mustMarshal(whole)}:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			recycle(pc)
		}
		return nil
	})
	g.Go(func() error {
		c := sha256.New()
		for pc := range toWrite {
			if _, err := p.file.WriteAt(pc.buf[:pc.n], pc.off); err != nil {
				return fmt.Errorf("writing %s: %w", p.file.Name(), diskErr(err))
			}
			c.Write(pc.buf[:pc.n])
			end := pc.off + int64(pc.n)
			f.report(end, 0)
			if end == chunkEnd(pc.off) {
				select {
				case written <- chunkDone{index: pc.off / cs, data: c.Sum(nil)}:
				case <-ctx.Done():
					return ctx.Err()
				}
				c.Reset()
			}
			recycle(pc)
		}
		return nil
	})
	g.Go(func() error {
		for next := from / cs; next < int64(p.n); next++ {
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
			if h.index != next || w.index != next {
				return fmt.Errorf("internal error: chunks %d/%d arrived, want %d", h.index, w.index, next)
			}
			p.markStreamed(int(next), w.data, h.data)
			if next < int64(p.n)-1 {
				if err := p.checkpoint(false); err != nil {
					return err
				}
			}
		}
		return nil
	})
	return g.Wait()
}

// read pulls [from, size) from src into pieces that never straddle a chunk,
// handing each to emit. A failed or stalled request is retried from the next
// byte needed, with exponential backoff and jitter; attempts that make
// progress reset the count. Errors marked Permanent end it at once.
func (s *Store) read(ctx context.Context, src content.RangeOpener, desc content.Descriptor, from int64,
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
		if errors.Is(err, content.ErrPermanent) {
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
func (s *Store) readAttempt(ctx context.Context, src content.RangeOpener, desc content.Descriptor, next *int64,
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
		return content.Permanent(fmt.Errorf("%w: source sent more than %d bytes", content.ErrSizeMismatch, desc.Size))
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

// commit makes a verified download visible: fsync, read-only, rename into
// blobs/, fsync the directory, index it.
func (s *Store) commit(p *Partial) (Info, error) {
	p.mu.Lock()
	st := p.st.clone()
	p.mu.Unlock()
	h := sha256.New().(hashState)
	if err := h.UnmarshalBinary(st.HashState); err != nil || st.Hashed != st.Size {
		return Info{}, fmt.Errorf("internal error: committing %s with %d of %d bytes hashed", st.Digest, st.Hashed, st.Size)
	}
	if got := digest.NewDigest(digest.SHA256, h); got != st.Digest {
		s.log.Warn("downloaded blob does not match its digest", "want", st.Digest, "got", got)
		return Info{}, fmt.Errorf("%w: got %s", content.ErrDigestMismatch, got)
	}
	if err := fdatasync(p.file); err != nil {
		return Info{}, fmt.Errorf("syncing %s: %w", p.file.Name(), err)
	}
	if err := p.file.Chmod(0o444); err != nil {
		return Info{}, err
	}
	dst, _ := s.BlobPath(st.Digest)
	if err := os.Rename(s.partialData(st.Digest), dst); err != nil {
		return Info{}, fmt.Errorf("committing blob %s: %w", st.Digest, err)
	}
	if err := SyncDir(blobsDir(s.root)); err != nil {
		return Info{}, err
	}
	os.Remove(s.partialStatePath(st.Digest))
	rec := &record{Size: st.Size, LastAccess: time.Now(), ChunkSize: st.ChunkSize, Chunks: st.Chunks}
	if err := s.putBlob(st.Digest, rec); err != nil {
		// The blob is durable and verified; the next Open reconciles the index.
		s.log.Warn("indexing committed blob", "digest", st.Digest, "err", err)
	} else {
		rec.saved = rec.LastAccess
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
