package cache

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/weightd/weightd/pkg/content"
)

var (
	bucketBlobs  = []byte("blobs")
	bucketModels = []byte("models")
)

// record is what the index keeps of a complete blob.
type record struct {
	Size       int64            `json:"size"`
	LastAccess time.Time        `json:"lastAccess"`
	Pins       map[string]int64 `json:"pins,omitempty"` // owner → unix time pinned
	ChunkSize  int64            `json:"chunkSize,omitempty"`
	Chunks     []byte           `json:"chunks,omitempty"` // concatenated sha256 of each chunk

	// saved is the last access written, or being written, to the index (not
	// stored itself): touchAll writes LastAccess only once it runs ahead of
	// saved by the access granularity.
	saved time.Time
}

// modelRecord remembers a materialised snapshot so that evicting one of its
// blobs also removes the snapshot (no dangling links).
type modelRecord struct {
	Dir    string          `json:"dir"` // relative to the root
	Digest []digest.Digest `json:"digests"`
}

// Store is the content-addressed cache. It is safe for concurrent use.
type Store struct {
	root string
	opts options
	log  *slog.Logger
	m    *metrics
	db   *bolt.DB

	ctx    context.Context // cancelled by Close; parent of every download
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.RWMutex // guards blobs, flights, partials and closed; never held across I/O
	blobs    map[digest.Digest]*record
	flights  map[digest.Digest]*flight
	partials map[digest.Digest]int64 // idle partial downloads on disk → reserved bytes
	holds    map[digest.Digest]int   // in-memory holds against eviction (see Hold)
	reserved int64                   // bytes reserved by downloads in flight
	closed   bool

	evictMu  sync.Mutex // serialises reservations so two downloads don't count the same free space
	modelsMu sync.Mutex // orders materialising models against evicting their blobs
	// synced names the model snapshots ("name@revision") this process has
	// made durable (fsynced), written or found whole. Guarded by modelsMu.
	synced map[string]bool
}

// Usage is a snapshot of what the store holds.
type Usage struct {
	Root         string   `json:"root"`
	Bytes        int64    `json:"bytes"`
	Blobs        int      `json:"blobs"`
	PartialBytes int64    `json:"partialBytes"`
	BudgetBytes  int64    `json:"budgetBytes"`
	DiskFree     int64    `json:"diskFree"`
	MinFree      int64    `json:"minFree"` // the floor of free space the store keeps (WithMinFree)
	InFlight     []Flight `json:"inFlight,omitempty"`
}

// Flight is a download in progress.
type Flight struct {
	Digest  digest.Digest `json:"digest"`
	Size    int64         `json:"size"`
	Done    int64         `json:"done"`
	Waiters int           `json:"waiters"`
	HeldFor time.Duration `json:"heldFor"` // how long the download has held the blob
}

// Open opens (creating if needed) the store rooted at root. Only one process
// may open a root at a time.
func Open(root string, opts ...Option) (*Store, error) {
	o := defaultOptions()
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	root, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("cache root %q: %w", root, err)
	}
	for _, dir := range []string{blobsDir(root), partialDir(root), modelsDir(root)} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("creating %s: %w", dir, err)
		}
	}
	db, err := bolt.Open(filepath.Join(root, "index.db"), 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		if errors.Is(err, bolterrors.ErrTimeout) {
			return nil, fmt.Errorf("opening cache index in %s: in use by another process", root)
		}
		return nil, fmt.Errorf("opening cache index in %s: %w", root, err)
	}
	m, err := newMetrics(o.registerer)
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("registering cache metrics: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Store{
		root: root, opts: o, log: o.logger, m: m, db: db,
		ctx: ctx, cancel: cancel,
		blobs:    make(map[digest.Digest]*record),
		flights:  make(map[digest.Digest]*flight),
		partials: make(map[digest.Digest]int64),
		holds:    make(map[digest.Digest]int),
		synced:   make(map[string]bool),
	}
	if err := s.load(); err != nil {
		cancel()
		db.Close()
		return nil, err
	}
	return s, nil
}

// load reads the index and reconciles it with the files on disk: a blob file
// without a record gets one, a record without a file is dropped, a model
// snapshot whose blobs are gone is removed, leftover temp files are deleted.
func (s *Store) load() error {
	err := s.db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucketIfNotExists(bucketBlobs)
		if err != nil {
			return err
		}
		if _, err := tx.CreateBucketIfNotExists(bucketModels); err != nil {
			return err
		}
		return b.ForEach(func(k, v []byte) error {
			d := digest.NewDigestFromEncoded(digest.SHA256, string(k))
			var r record
			if content.ValidateDigest(d) != nil || json.Unmarshal(v, &r) != nil {
				s.log.Warn("dropping malformed index record", "key", string(k))
				return b.Delete(k)
			}
			s.blobs[d] = &r
			return nil
		})
	})
	if err != nil {
		return fmt.Errorf("loading cache index: %w", err)
	}

	onDisk := make(map[digest.Digest]int64)
	entries, err := os.ReadDir(blobsDir(s.root))
	if err != nil {
		return fmt.Errorf("reading %s: %w", blobsDir(s.root), err)
	}
	for _, e := range entries {
		d := digest.NewDigestFromEncoded(digest.SHA256, e.Name())
		info, err := e.Info()
		if err != nil || !info.Mode().IsRegular() || content.ValidateDigest(d) != nil {
			s.log.Warn("removing stray file from blobs", "name", e.Name())
			os.Remove(filepath.Join(blobsDir(s.root), e.Name()))
			continue
		}
		onDisk[d] = info.Size()
	}
	var drop []digest.Digest
	for d, r := range s.blobs {
		if size, ok := onDisk[d]; !ok || size != r.Size {
			drop = append(drop, d)
		}
	}
	for _, d := range drop {
		s.log.Warn("index names a blob that is not on disk; forgetting it", "digest", d)
		delete(s.blobs, d)
	}
	now := time.Now()
	for d, size := range onDisk {
		if _, ok := s.blobs[d]; !ok {
			// Only a verified blob is ever renamed into blobs/: a crash between
			// the rename and the index update leaves one without a record.
			s.blobs[d] = &record{Size: size, LastAccess: now}
		}
	}
	if err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketBlobs)
		for _, d := range drop {
			if err := b.Delete([]byte(d.Encoded())); err != nil {
				return err
			}
		}
		for d, r := range s.blobs {
			if b.Get([]byte(d.Encoded())) == nil {
				if err := putRecord(b, d, r); err != nil {
					return err
				}
			}
		}
		return nil
	}); err != nil {
		return fmt.Errorf("reconciling cache index: %w", err)
	}
	for _, r := range s.blobs {
		r.saved = r.LastAccess // no one else holds the records yet
	}
	if err := s.loadPartials(); err != nil {
		return err
	}
	if err := s.pruneModels(); err != nil {
		return err
	}
	s.updateGauges()
	return nil
}

// Close cancels downloads in flight (they keep their progress for a later
// resume), waits for them, writes the last accesses not yet in the index
// and closes the index.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	s.mu.RLock()
	last := make(map[digest.Digest]time.Time)
	for d, r := range s.blobs {
		if r.LastAccess.After(r.saved) {
			last[d] = r.LastAccess
		}
	}
	s.mu.RUnlock()
	if len(last) > 0 {
		if err := s.db.Update(func(tx *bolt.Tx) error { return saveAccess(tx, last) }); err != nil {
			s.log.Warn("recording blob accesses", "err", err)
		}
	}
	return s.db.Close()
}

// Root is the store's root directory.
func (s *Store) Root() string { return s.root }

// BlobPath is where the complete blob d lives (whether or not it is there).
func (s *Store) BlobPath(d digest.Digest) (string, error) {
	if err := content.ValidateDigest(d); err != nil {
		return "", err
	}
	return filepath.Join(blobsDir(s.root), d.Encoded()), nil
}

// Stat describes the complete blob d, or returns ErrNotFound.
func (s *Store) Stat(d digest.Digest) (Info, error) {
	if err := content.ValidateDigest(d); err != nil {
		return Info{}, err
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	r, ok := s.blobs[d]
	if !ok {
		return Info{}, fmt.Errorf("blob %s: %w", d, content.ErrNotFound)
	}
	return r.info(d), nil
}

// Open opens the complete blob d for reading and marks it used. Eviction may
// unlink the file while it is open; the reader keeps its bytes.
func (s *Store) Open(d digest.Digest) (*os.File, error) {
	if _, err := s.Stat(d); err != nil {
		return nil, err
	}
	p, _ := s.BlobPath(d)
	f, err := os.Open(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("blob %s: %w", d, content.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("opening blob %s: %w", d, err)
	}
	s.touch(d)
	return f, nil
}

// List describes every complete blob, most recently used first.
func (s *Store) List() []Info {
	s.mu.RLock()
	out := make([]Info, 0, len(s.blobs))
	for d, r := range s.blobs {
		out = append(out, r.info(d))
	}
	s.mu.RUnlock()
	slices.SortFunc(out, func(a, b Info) int { return b.LastAccess.Compare(a.LastAccess) })
	return out
}

// Usage reports what the store holds and the downloads in flight.
func (s *Store) Usage() Usage {
	sp, _ := s.space()
	s.mu.RLock()
	defer s.mu.RUnlock()
	u := Usage{Root: s.root, BudgetBytes: sp.budget, DiskFree: sp.free, MinFree: sp.floor, Blobs: len(s.blobs)}
	u.Bytes, u.PartialBytes = s.bytesLocked()
	for d, f := range s.flights {
		u.InFlight = append(u.InFlight, Flight{
			Digest: d, Size: f.desc.Size, Done: f.done.Load(), Waiters: f.waiters,
			HeldFor: time.Since(f.started).Round(time.Millisecond),
		})
	}
	slices.SortFunc(u.InFlight, func(a, b Flight) int { return int(b.HeldFor - a.HeldFor) })
	return u
}

// Pin keeps the complete blob d from eviction until every owner unpins it.
// Pins survive restarts.
func (s *Store) Pin(d digest.Digest, owner string) error {
	return s.updatePins(d, owner, true)
}

// Hold keeps the blob d from eviction, whether it is present yet or not,
// until release is called (once). Unlike a pin it lives in memory only: it
// protects work in progress, such as the first files of a model while the
// last ones download.
func (s *Store) Hold(d digest.Digest) (release func()) {
	s.mu.Lock()
	s.holds[d]++
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			if s.holds[d]--; s.holds[d] <= 0 {
				delete(s.holds, d)
			}
			s.mu.Unlock()
		})
	}
}

// Unpin drops owner's pin on d. Unpinning what is not pinned is not an error.
func (s *Store) Unpin(d digest.Digest, owner string) error {
	return s.updatePins(d, owner, false)
}

func (s *Store) updatePins(d digest.Digest, owner string, pin bool) error {
	if err := content.ValidateDigest(d); err != nil {
		return err
	}
	if owner == "" {
		return fmt.Errorf("%w: empty pin owner", content.ErrInvalid)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.blobs[d]
	if !ok {
		if !pin {
			return nil
		}
		return fmt.Errorf("pinning blob %s: %w", d, content.ErrNotFound)
	}
	next := *r
	next.Pins = clonePins(r.Pins)
	if pin {
		next.Pins[owner] = time.Now().Unix()
	} else {
		delete(next.Pins, owner)
	}
	// The index write is small; holding the lock keeps pin and evict ordered.
	if err := s.db.Update(func(tx *bolt.Tx) error { return putRecord(tx.Bucket(bucketBlobs), d, &next) }); err != nil {
		return fmt.Errorf("saving pins of %s: %w", d, err)
	}
	s.blobs[d] = &next
	return nil
}

// touch records an access for LRU eviction.
func (s *Store) touch(d digest.Digest) { s.touchAll([]digest.Digest{d}) }

// bytesLocked sums the complete blobs, and the partial downloads: idle ones
// on disk and those in flight (their reservations). s.mu must be held.
func (s *Store) bytesLocked() (stored, partial int64) {
	for _, r := range s.blobs {
		stored += r.Size
	}
	for _, n := range s.partials {
		partial += n
	}
	return stored, partial + s.reserved
}

func (s *Store) updateGauges() {
	s.mu.RLock()
	bytes, partial := s.bytesLocked()
	n := len(s.blobs)
	s.mu.RUnlock()
	s.m.storedBytes.Set(float64(bytes))
	s.m.storedBlobs.Set(float64(n))
	s.m.partialBytes.Set(float64(partial))
}

func (r *record) info(d digest.Digest) Info {
	info := Info{Descriptor: content.Descriptor{Digest: d, Size: r.Size}, LastAccess: r.LastAccess}
	for owner := range r.Pins {
		info.Pins = append(info.Pins, owner)
	}
	slices.Sort(info.Pins)
	return info
}

func putRecord(b *bolt.Bucket, d digest.Digest, r *record) error {
	v, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return b.Put([]byte(d.Encoded()), v)
}

func clonePins(m map[string]int64) map[string]int64 {
	out := make(map[string]int64, len(m)+1)
	for k, v := range m {
		out[k] = v
	}
	return out
}

func blobsDir(root string) string   { return filepath.Join(root, "blobs", "sha256") }
func partialDir(root string) string { return filepath.Join(root, "partial") }
func modelsDir(root string) string  { return filepath.Join(root, "models") }

// chunkHashes returns the chunk size and concatenated chunk hashes of the
// complete blob d, computing and saving them if the index lost them (a blob
// recovered after a crash).
func (s *Store) chunkHashes(d digest.Digest) (int64, []byte, error) {
	info, err := s.Stat(d)
	if err != nil {
		return 0, nil, err
	}
	s.mu.RLock()
	r := s.blobs[d]
	s.mu.RUnlock()
	if r != nil && r.ChunkSize != 0 {
		return r.ChunkSize, r.Chunks, nil
	}
	f, err := s.Open(d)
	if err != nil {
		return 0, nil, err
	}
	chunks, err := hashChunks(f, info.Size, s.opts.chunkSize)
	f.Close()
	if err != nil {
		return 0, nil, fmt.Errorf("hashing chunks of %s: %w", d, err)
	}
	s.mu.Lock()
	cur, ok := s.blobs[d]
	if ok {
		next := *cur
		next.ChunkSize, next.Chunks = s.opts.chunkSize, chunks
		s.blobs[d] = &next
		r = &next
	}
	s.mu.Unlock()
	if !ok {
		return 0, nil, fmt.Errorf("blob %s: %w", d, content.ErrNotFound)
	}
	if err := s.putBlob(d, r); err != nil {
		s.log.Warn("saving chunk hashes", "digest", d, "err", err)
	}
	return r.ChunkSize, chunks, nil
}

func hashChunks(r io.ReaderAt, size, chunkSize int64) ([]byte, error) {
	var out []byte
	h := sha256.New()
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; off += chunkSize {
		h.Reset()
		if _, err := io.CopyBuffer(h, io.NewSectionReader(r, off, min(chunkSize, size-off)), buf); err != nil {
			return nil, err
		}
		out = h.Sum(out)
	}
	return out, nil
}
