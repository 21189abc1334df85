package cache

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

const partialStateVersion = 2

// partialState is the persisted progress of a download. Chunk i is present
// (bit i of Have) when its bytes are durable in the data file and hash to
// Chunks[i]. The whole-blob sha256 state HashState covers [0, Hashed), a
// prefix of present chunks.
type partialState struct {
	Version   int           `json:"version"`
	Digest    digest.Digest `json:"digest"`
	Size      int64         `json:"size"`
	ChunkSize int64         `json:"chunkSize"`
	Have      []byte        `json:"have"`
	Chunks    []byte        `json:"chunks"`
	Hashed    int64         `json:"hashed"`
	HashState []byte        `json:"hashState"`
}

func chunkCount(size, chunkSize int64) int { return int((size + chunkSize - 1) / chunkSize) }

func (st *partialState) has(i int) bool { return st.Have[i/8]&(1<<(i%8)) != 0 }

func (st *partialState) set(i int, sum []byte) {
	st.Have[i/8] |= 1 << (i % 8)
	copy(st.Chunks[i*sha256.Size:], sum)
}

func (st *partialState) clear(i int) { st.Have[i/8] &^= 1 << (i % 8) }

func (st *partialState) clone() partialState {
	c := *st
	c.Have, c.Chunks, c.HashState = bytes.Clone(st.Have), bytes.Clone(st.Chunks), bytes.Clone(st.HashState)
	return c
}

func newPartialState(desc content.Descriptor, chunkSize int64) *partialState {
	n := chunkCount(desc.Size, chunkSize)
	return &partialState{
		Version: partialStateVersion, Digest: desc.Digest, Size: desc.Size, ChunkSize: chunkSize,
		Have: make([]byte, (n+7)/8), Chunks: make([]byte, n*sha256.Size),
		HashState: mustMarshal(sha256.New().(hashState)),
	}
}

// Partial is a download in progress: a pre-allocated data file filled chunk
// by chunk, in any order, from any source. A ChunkFiller gets one from Fetch;
// the chunk server reads its present chunks while it fills. It is safe for
// concurrent use.
type Partial struct {
	s    *Store
	desc content.Descriptor
	file *os.File
	f    *flight
	n    int
	cs   int64

	mu      sync.Mutex
	st      *partialState
	present int64                 // bytes in present chunks
	peers   int64                 // of present, the bytes peers sent since it was opened
	writing map[int]chan struct{} // chunk → closed when its one writer is done

	hashMu sync.Mutex // serialises advancing the whole-blob hash
	whole  hashState  // covers [0, st.Hashed); guarded by hashMu

	cpMu   sync.Mutex
	lastCP time.Time
}

// Descriptor is the blob being downloaded.
func (p *Partial) Descriptor() content.Descriptor { return p.desc }

// ChunkSize is the size of every chunk but the last.
func (p *Partial) ChunkSize() int64 { return p.cs }

// Chunks is the number of chunks.
func (p *Partial) Chunks() int { return p.n }

// ChunkLen is the size of chunk i.
func (p *Partial) ChunkLen(i int) int64 { return min(p.cs, p.desc.Size-int64(i)*p.cs) }

// Has reports whether chunk i is present and verified.
func (p *Partial) Has(i int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return i >= 0 && i < p.n && p.st.has(i)
}

// Missing lists the chunks not yet present, in order.
func (p *Partial) Missing() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []int
	for i := range p.n {
		if !p.st.has(i) {
			out = append(out, i)
		}
	}
	return out
}

// Hash returns the recorded sha256 of chunk i, or nil if it is not present.
func (p *Partial) Hash(i int) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	if i < 0 || i >= p.n || !p.st.has(i) {
		return nil
	}
	return bytes.Clone(p.st.Chunks[i*sha256.Size : (i+1)*sha256.Size])
}

// Present is the number of bytes in present chunks.
func (p *Partial) Present() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.present
}

// state returns a copy of the bitmap and chunk hashes.
func (p *Partial) state() (have, hashes []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return bytes.Clone(p.st.Have), bytes.Clone(p.st.Chunks)
}

// WriteChunk stores chunk i. With want set, data must hash to it or the
// chunk is refused with ErrDigestMismatch and nothing is marked; with want
// nil (a trusted origin) the hash is computed and recorded as the chunk's.
// A chunk already present is left as it is. The whole blob is still checked
// against its digest before it is committed.
//
// One writer at a time writes a chunk that is not present, and marks it
// present with the hash of what it wrote; the others wait for it and, once
// it is present, return without writing. So writers of one chunk with
// different bytes (an endgame duplicate from a peer whose chunk map lies,
// checked against the lie) never mix: the bytes in the file are those whose
// hash is recorded, and those the whole-blob hash is fed.
func (p *Partial) WriteChunk(i int, data []byte, want []byte) error {
	return p.writeChunk(i, data, want, false)
}

// WritePeerChunk is WriteChunk for a chunk a peer sent: the fetch's
// progress counts it as from peers.
func (p *Partial) WritePeerChunk(i int, data []byte, want []byte) error {
	return p.writeChunk(i, data, want, true)
}

func (p *Partial) writeChunk(i int, data []byte, want []byte, fromPeer bool) error {
	if i < 0 || i >= p.n {
		return fmt.Errorf("%w: chunk %d of %d", content.ErrInvalid, i, p.n)
	}
	if int64(len(data)) != p.ChunkLen(i) {
		return fmt.Errorf("%w: chunk %d is %d bytes, want %d", content.ErrSizeMismatch, i, len(data), p.ChunkLen(i))
	}
	sum := sha256.Sum256(data)
	if want != nil && !bytes.Equal(sum[:], want) {
		return fmt.Errorf("%w: chunk %d", content.ErrDigestMismatch, i)
	}
	done := p.claim(i)
	if done == nil {
		return nil // present
	}
	if _, err := p.file.WriteAt(data, int64(i)*p.cs); err != nil {
		p.mu.Lock()
		delete(p.writing, i)
		p.mu.Unlock()
		close(done)
		return fmt.Errorf("writing chunk %d of %s: %w", i, p.desc.Digest, diskErr(err))
	}
	p.s.m.ingestBytes.Add(float64(len(data)))
	p.mu.Lock()
	p.st.set(i, sum[:]) // only the claimant marks it: it is not present
	p.present += int64(len(data))
	if fromPeer {
		p.peers += int64(len(data))
	}
	present, peers := p.present, p.peers
	delete(p.writing, i)
	p.mu.Unlock()
	close(done)
	p.f.report(present, peers)
	p.s.emit(Event{Kind: EventChunk, Digest: p.desc.Digest, Chunk: i})
	if err := p.advanceHash(i, data, sum[:]); err != nil {
		return err
	}
	return p.checkpoint(false)
}

// claim makes the caller the one writer of chunk i, waiting while another
// writer has it, and returns nil if the chunk is (or became) present. Else
// the caller writes the chunk, then, with p.mu held, marks it present (if
// the write succeeded) and deletes i from p.writing, then closes the
// channel claim returned, which wakes the writers waiting for it.
func (p *Partial) claim(i int) chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if p.st.has(i) {
			return nil
		}
		busy, ok := p.writing[i]
		if !ok {
			break
		}
		p.mu.Unlock()
		<-busy
		p.mu.Lock()
	}
	if p.writing == nil {
		p.writing = make(map[int]chan struct{})
	}
	done := make(chan struct{})
	p.writing[i] = done
	return done
}

// Invalidate forgets chunk i: its recorded hash was wrong (a lying chunk map)
// and it must be fetched again.
func (p *Partial) Invalidate(i int) {
	p.hashMu.Lock()
	defer p.hashMu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	if i < 0 || i >= p.n || !p.st.has(i) {
		return
	}
	p.st.clear(i)
	p.present -= p.ChunkLen(i)
	p.peers = min(p.peers, p.present) // which sender it was is not kept
	if int64(i)*p.cs < p.st.Hashed {
		p.whole = sha256.New().(hashState)
		p.st.Hashed, p.st.HashState = 0, mustMarshal(p.whole)
	}
}

// advanceHash feeds the whole-blob hash with the present chunks that extend
// its prefix: chunk i from data, which the caller just wrote and whose hash
// is sum, the others read back from the data file (usually the page cache).
// Whoever holds hashMu does the work; the others return at once, and the
// holder re-checks before it lets go, so no chunk is left behind.
func (p *Partial) advanceHash(i int, data, sum []byte) error {
	for {
		if !p.hashMu.TryLock() {
			return nil
		}
		err := p.hashPrefix(i, data, sum)
		p.hashMu.Unlock()
		if err != nil {
			return err
		}
		p.mu.Lock()
		next := int(p.st.Hashed / p.cs)
		more := p.st.Hashed < p.desc.Size && p.st.has(next)
		p.mu.Unlock()
		if !more {
			return nil
		}
	}
}

// hashPrefix runs with hashMu held. Chunk known, if not -1, was written as
// data, whose hash is sum: data is hashed instead of the file's bytes only
// while the chunk is present with that hash recorded, which its bytes in
// the file have (a present chunk is never written; one invalidated and
// written again since may hold other bytes, and is read back).
func (p *Partial) hashPrefix(known int, data, sum []byte) error {
	var buf []byte
	for {
		p.mu.Lock()
		off := p.st.Hashed
		i := int(off / p.cs)
		ok := off < p.desc.Size && p.st.has(i)
		inMemory := ok && i == known && bytes.Equal(p.st.Chunks[i*sha256.Size:(i+1)*sha256.Size], sum)
		p.mu.Unlock()
		if !ok {
			return nil
		}
		if inMemory {
			p.whole.Write(data)
		} else {
			if buf == nil {
				buf = make([]byte, 1<<20)
			}
			if _, err := io.CopyBuffer(p.whole, io.NewSectionReader(p.file, off, p.ChunkLen(i)), buf); err != nil {
				return fmt.Errorf("hashing chunk %d of %s: %w", i, p.desc.Digest, err)
			}
		}
		state := mustMarshal(p.whole)
		p.mu.Lock()
		p.st.Hashed, p.st.HashState = off+p.ChunkLen(i), state
		p.mu.Unlock()
	}
}

// Verify checks the whole blob against its digest once every chunk is
// present. A mismatch (ErrDigestMismatch) means a chunk map was wrong.
func (p *Partial) Verify() error {
	if missing := p.Missing(); len(missing) > 0 {
		return fmt.Errorf("%w: %d chunks of %s still missing", content.ErrInvalid, len(missing), p.desc.Digest)
	}
	p.hashMu.Lock()
	defer p.hashMu.Unlock()
	if err := p.hashPrefix(-1, nil, nil); err != nil {
		return err
	}
	if got := digest.NewDigest(digest.SHA256, p.whole); got != p.desc.Digest {
		return fmt.Errorf("%w: got %s", content.ErrDigestMismatch, got)
	}
	return nil
}

// markStreamed records chunk i of a sequential download that hashes the
// whole blob as it goes: state is the whole-blob hash after the chunk.
func (p *Partial) markStreamed(i int, sum, state []byte) {
	p.mu.Lock()
	if !p.st.has(i) {
		p.present += p.ChunkLen(i)
	}
	p.st.set(i, sum)
	p.st.Hashed, p.st.HashState = int64(i)*p.cs+p.ChunkLen(i), state
	p.mu.Unlock()
	p.s.emit(Event{Kind: EventChunk, Digest: p.desc.Digest, Chunk: i})
}

// checkpoint makes the progress durable: fsync the data, then save the state
// (atomically). Unless forced, it runs at most once per checkpoint interval.
func (p *Partial) checkpoint(force bool) error {
	p.cpMu.Lock()
	defer p.cpMu.Unlock()
	if !force && time.Since(p.lastCP) < p.s.opts.checkpoint {
		return nil
	}
	p.mu.Lock()
	st := p.st.clone()
	p.mu.Unlock()
	if err := fdatasync(p.file); err != nil {
		return fmt.Errorf("syncing partial %s: %w", st.Digest, err)
	}
	b, err := json.Marshal(&st)
	if err == nil {
		err = WriteFileAtomic(p.s.partialStatePath(st.Digest), b, 0o600)
	}
	if err != nil {
		return fmt.Errorf("saving progress of %s: %w", st.Digest, err)
	}
	p.lastCP = time.Now()
	return nil
}

// openPartial resumes the saved progress of desc in file, keeping only the
// chunks that still hash to their recorded sums, or starts from nothing.
func (s *Store) openPartial(f *flight, file *os.File) *Partial {
	desc := f.desc
	p := &Partial{s: s, desc: desc, file: file, f: f, cs: s.opts.chunkSize, lastCP: time.Now()}
	p.n = chunkCount(desc.Size, p.cs)
	p.st = s.readState(desc)
	if p.st == nil {
		p.st = newPartialState(desc, p.cs)
	}
	buf := make([]byte, 1<<20)
	h := sha256.New()
	prefixOK := true
	for i := range p.n {
		if !p.st.has(i) {
			continue
		}
		h.Reset()
		_, err := io.CopyBuffer(h, io.NewSectionReader(file, int64(i)*p.cs, p.ChunkLen(i)), buf)
		if err != nil || !bytes.Equal(h.Sum(nil), p.st.Chunks[i*sha256.Size:(i+1)*sha256.Size]) {
			s.log.Warn("dropping a saved chunk that no longer matches its hash", "digest", desc.Digest, "chunk", i)
			p.st.clear(i)
			if int64(i)*p.cs < p.st.Hashed {
				prefixOK = false
			}
			continue
		}
		p.present += p.ChunkLen(i)
	}
	p.whole = sha256.New().(hashState)
	if !prefixOK || p.whole.UnmarshalBinary(p.st.HashState) != nil {
		p.whole = sha256.New().(hashState)
		p.st.Hashed, p.st.HashState = 0, mustMarshal(p.whole)
	}
	if p.present > 0 {
		s.log.Info("resuming download", "digest", desc.Digest, "present", p.present, "size", desc.Size)
	}
	return p
}

func (s *Store) partialData(d digest.Digest) string {
	return filepath.Join(partialDir(s.root), d.Encoded()+".data")
}

func (s *Store) partialStatePath(d digest.Digest) string {
	return filepath.Join(partialDir(s.root), d.Encoded()+".state")
}

// loadPartials finds the partial downloads left on disk by an earlier run;
// they are resumed when their blob is asked for again and evictable until then.
func (s *Store) loadPartials() error {
	dir := partialDir(s.root)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("reading %s: %w", dir, err)
	}
	for _, e := range entries {
		name := e.Name()
		hex, isData := strings.CutSuffix(name, ".data")
		if !isData {
			hex, _ = strings.CutSuffix(name, ".state")
		}
		d := digest.NewDigestFromEncoded(digest.SHA256, hex)
		if content.ValidateDigest(d) != nil || (!isData && !strings.HasSuffix(name, ".state")) {
			os.Remove(filepath.Join(dir, name)) // temp files of an interrupted state write
			continue
		}
		if !isData {
			if _, err := os.Stat(s.partialData(d)); errors.Is(err, os.ErrNotExist) {
				os.Remove(filepath.Join(dir, name))
			}
			continue
		}
		if _, complete := s.blobs[d]; complete {
			s.removePartial(d)
			continue
		}
		if info, err := e.Info(); err == nil {
			s.partials[d] = info.Size()
		}
	}
	return nil
}

// readState returns the saved progress of d if it is usable for desc with the
// store's chunk size, and nil otherwise.
func (s *Store) readState(desc content.Descriptor) *partialState {
	b, err := os.ReadFile(s.partialStatePath(desc.Digest))
	if err != nil {
		return nil
	}
	var st partialState
	if err := json.Unmarshal(b, &st); err != nil {
		s.log.Warn("discarding unreadable partial state", "digest", desc.Digest, "err", err)
		return nil
	}
	cs := s.opts.chunkSize
	n := chunkCount(desc.Size, cs)
	switch {
	case st.Version != partialStateVersion, st.Digest != desc.Digest, st.Size != desc.Size, st.ChunkSize != cs,
		len(st.Have) != (n+7)/8, len(st.Chunks) != n*sha256.Size,
		st.Hashed < 0, st.Hashed > st.Size, st.Hashed%cs != 0 && st.Hashed != st.Size:
		s.log.Info("partial state does not match; starting over", "digest", desc.Digest)
		return nil
	}
	for i := range int(st.Hashed / cs) {
		if !st.has(i) {
			return nil
		}
	}
	return &st
}

func (s *Store) removePartial(d digest.Digest) {
	os.Remove(s.partialStatePath(d))
	os.Remove(s.partialData(d))
}
