package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	bolt "go.etcd.io/bbolt"

	"github.com/weightd/weightd/pkg/content"
)

// space is what the store may use and what its filesystem has.
type space struct {
	budget int64 // the most bytes the store may occupy
	total  int64 // the filesystem's size
	free   int64 // bytes free on it
	floor  int64 // bytes the store leaves free (WithMinFree)
}

// space reads the filesystem and returns the store's budget and floor on it.
func (s *Store) space() (space, error) {
	total, free, err := fsSpace(s.root)
	if err != nil {
		return space{}, err
	}
	sp := space{budget: total, total: total, free: free}
	if s.opts.budgetPercent > 0 {
		sp.budget = int64(float64(total) * s.opts.budgetPercent / 100)
	}
	if s.opts.budgetBytes > 0 {
		sp.budget = min(sp.budget, s.opts.budgetBytes)
	}
	sp.floor = max(s.opts.minFreeBytes, int64(float64(total)*s.opts.minFreePercent/100))
	s.m.budgetBytes.Set(float64(sp.budget))
	s.m.minFreeBytes.Set(float64(sp.floor))
	return sp, nil
}

// reserve makes room for desc under the budget, evicting least recently used
// blobs and idle partial downloads if needed, and returns the partial data
// file, allocated to its full size. A blob that cannot fit is ErrDiskFull.
func (s *Store) reserve(desc content.Descriptor) (*os.File, error) {
	s.evictMu.Lock()
	defer s.evictMu.Unlock()

	d := desc.Digest
	s.mu.Lock()
	existing, resumable := s.partials[d]
	delete(s.partials, d)
	s.reserved += desc.Size
	s.mu.Unlock()
	if existing != desc.Size {
		resumable = false
	}
	fail := func(err error) (*os.File, error) {
		s.removePartial(d)
		s.mu.Lock()
		s.reserved -= desc.Size
		s.mu.Unlock()
		s.updateGauges()
		return nil, err
	}
	if !resumable {
		s.removePartial(d) // a leftover of another size or chunking
		existing = 0
	}
	if err := s.makeRoom(desc.Size-existing, d); err != nil {
		return fail(err)
	}
	file, err := os.OpenFile(s.partialData(d), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fail(fmt.Errorf("creating partial file for %s: %w", d, diskErr(err)))
	}
	if err := allocate(file, desc.Size); err != nil {
		file.Close()
		return fail(fmt.Errorf("allocating %d bytes for %s: %w", desc.Size, d, err))
	}
	s.updateGauges()
	return file, nil
}

// makeRoom evicts until need more bytes fit under the budget and on the
// disk above the free-space floor; the bytes of the reservation asking for
// them are already counted as used (s.reserved). evictMu must be held. The
// blob being reserved (self; "" for none) is never a candidate. What could
// not fit even with every candidate evicted is refused before any is.
func (s *Store) makeRoom(need int64, self digest.Digest) error {
	sp, err := s.space()
	if err != nil {
		return err
	}
	if err := s.canFit(need, self, sp); err != nil {
		return err
	}
	for {
		s.mu.RLock()
		stored, partial := s.bytesLocked()
		s.mu.RUnlock()
		used := stored + partial
		if used <= sp.budget && (need == 0 || need <= sp.free-sp.floor) {
			return nil
		}
		victim, isPartial, ok := s.lruCandidate(self)
		if !ok {
			return fmt.Errorf("%w: need %d bytes for %s: budget %d, in use %d (pinned or downloading), %d free on disk, %d kept free",
				ErrDiskFull, need, what(self), sp.budget, used, sp.free, sp.floor)
		}
		if err := s.evict(victim, isPartial); err != nil {
			return err
		}
		if sp, err = s.space(); err != nil {
			return err
		}
	}
}

// canFit refuses need more bytes for self that could not fit even with every
// blob that is neither pinned nor held, and every idle partial download,
// evicted: over the budget with what is left, or more than the free space
// above the floor plus what eviction could give back. A size claimed by a
// manifest, an origin or a registry (2^55 bytes, say) is refused so before
// it costs the cache anything. evictMu must be held.
func (s *Store) canFit(need int64, self digest.Digest, sp space) error {
	var evictable int64
	s.mu.RLock()
	stored, partial := s.bytesLocked()
	for d, r := range s.blobs {
		if len(r.Pins) == 0 && s.holds[d] == 0 {
			evictable += r.Size
		}
	}
	for d, n := range s.partials {
		if d != self {
			evictable += n
		}
	}
	s.mu.RUnlock()
	if kept := stored + partial - evictable; kept > sp.budget {
		return fmt.Errorf("%w: %d bytes for %s cannot fit in the budget of %d: %d would stay pinned, held or reserved by downloads, this one included",
			ErrDiskFull, need, what(self), sp.budget, kept)
	}
	if need > 0 && need > sp.free+evictable-sp.floor {
		return fmt.Errorf("%w: %d bytes for %s cannot fit: %d free on disk, %d more if every unpinned blob were evicted, %d kept free (filesystem of %d)",
			ErrDiskFull, need, what(self), sp.free, evictable, sp.floor, sp.total)
	}
	return nil
}

// what names the content a reservation is for in messages.
func what(d digest.Digest) string {
	if d == "" {
		return "content being stored"
	}
	return d.String()
}

// lruCandidate picks the least recently used blob that is neither pinned nor
// held, or idle partial.
func (s *Store) lruCandidate(self digest.Digest) (d digest.Digest, isPartial, ok bool) {
	var oldest time.Time
	var partials []digest.Digest
	s.mu.RLock()
	for cand, r := range s.blobs {
		if len(r.Pins) == 0 && s.holds[cand] == 0 && (!ok || r.LastAccess.Before(oldest)) {
			d, oldest, ok, isPartial = cand, r.LastAccess, true, false
		}
	}
	for cand := range s.partials {
		if cand != self {
			partials = append(partials, cand)
		}
	}
	s.mu.RUnlock()
	// An idle partial's age is its data file's mtime, read outside the lock.
	for _, cand := range partials {
		mtime := time.Time{}
		if info, err := os.Stat(s.partialData(cand)); err == nil {
			mtime = info.ModTime()
		}
		if !ok || mtime.Before(oldest) {
			d, oldest, ok, isPartial = cand, mtime, true, true
		}
	}
	return d, isPartial, ok
}

// evict removes one blob (and the model snapshots linking to it) or one idle
// partial download.
func (s *Store) evict(d digest.Digest, isPartial bool) error {
	var size int64
	if isPartial {
		s.mu.Lock()
		size = s.partials[d]
		delete(s.partials, d)
		s.mu.Unlock()
		s.removePartial(d)
	} else {
		var err error
		if size, err = s.removeBlob(d, false); err != nil || size < 0 {
			return err
		}
	}
	s.log.Info("evicted", "digest", d, "bytes", size, "partial", isPartial)
	s.m.evictions.Inc()
	s.m.evictedBytes.Add(float64(size))
	s.updateGauges()
	return nil
}

// Discard forgets the complete blob d, whose file someone removed or changed
// by hand: its record, its file and the snapshots linking to it go, whatever
// pins or holds it, since its bytes are no longer the verified ones, and the
// next Fetch downloads it again.
func (s *Store) Discard(d digest.Digest) error {
	if err := content.ValidateDigest(d); err != nil {
		return err
	}
	size, err := s.removeBlob(d, true)
	if err != nil || size < 0 {
		return err
	}
	s.log.Warn("discarded a blob changed on disk", "digest", d, "bytes", size)
	s.updateGauges()
	return nil
}

// removeBlob removes the complete blob d and the snapshots linking to it,
// returning its size, or -1 if it is gone or (unless force) pinned or held.
func (s *Store) removeBlob(d digest.Digest, force bool) (int64, error) {
	s.modelsMu.Lock()
	defer s.modelsMu.Unlock()
	s.mu.Lock()
	r, ok := s.blobs[d]
	if !ok || (!force && (len(r.Pins) > 0 || s.holds[d] > 0)) {
		s.mu.Unlock()
		return -1, nil // gone, pinned or held since it was picked
	}
	delete(s.blobs, d)
	s.mu.Unlock()
	if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketBlobs).Delete([]byte(d.Encoded())) }); err != nil {
		return 0, fmt.Errorf("removing %s: %w", d, err)
	}
	p, _ := s.BlobPath(d)
	if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
		return 0, fmt.Errorf("removing %s: %w", d, err)
	}
	if err := s.pruneModelsLocked(); err != nil {
		return 0, err
	}
	s.emit(Event{Kind: EventRemoved, Digest: d})
	return r.Size, nil
}

func (s *Store) putBlob(d digest.Digest, r *record) error {
	return s.db.Update(func(tx *bolt.Tx) error { return putRecord(tx.Bucket(bucketBlobs), d, r) })
}

// pruneModels removes leftover temp snapshots and ref files and every
// snapshot that links to a blob no longer in the store, with the refs that
// name it.
func (s *Store) pruneModels() error {
	s.modelsMu.Lock()
	defer s.modelsMu.Unlock()
	tmps, _ := filepath.Glob(filepath.Join(modelsDir(s.root), "*", "snapshots", ".tmp-*"))
	for _, t := range tmps {
		os.RemoveAll(t)
	}
	// WriteFileAtomic's temp files, of refs whose writer died. A ref name
	// never starts with '.' (ValidateRef), so none is taken for one.
	refsDirs, _ := filepath.Glob(filepath.Join(modelsDir(s.root), "*", "refs"))
	for _, refsDir := range refsDirs {
		_ = filepath.WalkDir(refsDir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() && strings.HasPrefix(d.Name(), ".tmp-") {
				os.Remove(p)
			}
			return nil
		})
	}
	return s.pruneModelsLocked()
}

// removeRefsTo removes every ref of the repository holding snapshots dir
// (models/models--org--name/snapshots/<rev>) that holds <rev>: a ref to a
// snapshot that is gone makes the hub clients' cache scans
// (huggingface_hub's scan_cache_dir, huggingface.js's scanCachedRepo) call
// the whole repository corrupt.
func removeRefsTo(snapshot string) error {
	rev := filepath.Base(snapshot)
	refsDir := filepath.Join(filepath.Dir(filepath.Dir(snapshot)), "refs")
	var dirs []string
	err := filepath.WalkDir(refsDir, func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) && p == refsDir {
			return fs.SkipDir
		}
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		if b, err := os.ReadFile(p); err != nil || string(b) != rev {
			return err
		}
		if err := os.Remove(p); err != nil {
			return err
		}
		if dir := filepath.Dir(p); !slices.Contains(dirs, dir) {
			dirs = append(dirs, dir)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("removing the refs to %s: %w", snapshot, err)
	}
	for _, d := range dirs {
		if err := SyncDir(d); err != nil {
			return err
		}
	}
	return nil
}

func (s *Store) pruneModelsLocked() error {
	return s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketModels)
		var gone [][]byte
		err := b.ForEach(func(k, v []byte) error {
			var rec modelRecord
			if json.Unmarshal(v, &rec) != nil || !filepath.IsLocal(rec.Dir) {
				gone = append(gone, k)
				return nil
			}
			s.mu.RLock()
			complete := true
			for _, d := range rec.Digest {
				if _, ok := s.blobs[d]; !ok {
					complete = false
				}
			}
			s.mu.RUnlock()
			if !complete {
				s.log.Info("removing model snapshot whose blobs were evicted", "model", string(k))
				// The refs first: a crash between the two leaves a snapshot
				// without refs, which the next prune removes, never a ref
				// to no snapshot.
				dir := filepath.Join(s.root, rec.Dir)
				if filepath.Base(filepath.Dir(dir)) == "snapshots" {
					if err := removeRefsTo(dir); err != nil {
						return err
					}
				}
				if err := os.RemoveAll(dir); err != nil {
					return err
				}
				gone = append(gone, k)
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, k := range gone {
			if err := b.Delete(k); err != nil {
				return err
			}
			delete(s.synced, string(k))
		}
		return nil
	})
}

// touchAll records an access to each blob: in memory at once, where
// eviction reads it, and in the index only for the blobs whose access
// recorded there trails by the access granularity or more. That write runs
// behind the caller (one batched transaction, on the store's wait group), so
// a blob used again costs its user no write and no fsync; after a crash the
// LRU order is as precise as the granularity (Close writes what is left).
func (s *Store) touchAll(ds []digest.Digest) {
	now := time.Now()
	var stale map[digest.Digest]time.Time // → saved before, restored if the write fails
	s.mu.Lock()
	for _, d := range ds {
		r, ok := s.blobs[d]
		if !ok {
			continue
		}
		next := *r
		next.LastAccess = now
		if !s.closed && (now.Sub(r.saved) >= s.opts.accessGranularity || now.Before(r.saved)) {
			if stale == nil {
				stale = make(map[digest.Digest]time.Time, len(ds))
			}
			stale[d] = r.saved
			next.saved = now // written from now on: later touches need not write it again
		}
		s.blobs[d] = &next
	}
	if stale != nil {
		s.wg.Add(1) // under s.mu, with closed false: Close waits for it
	}
	s.mu.Unlock()
	if stale == nil {
		return
	}
	go func() {
		defer s.wg.Done()
		last := make(map[digest.Digest]time.Time, len(stale))
		for d := range stale {
			last[d] = now
		}
		err := s.db.Batch(func(tx *bolt.Tx) error { return saveAccess(tx, last) })
		if err == nil {
			return
		}
		s.log.Warn("recording blob access", "err", err)
		s.mu.Lock()
		for d, prev := range stale {
			if r, ok := s.blobs[d]; ok && r.saved.Equal(now) {
				next := *r
				next.saved = prev // a later touch, or Close, writes it
				s.blobs[d] = &next
			}
		}
		s.mu.Unlock()
	}()
}

// saveAccess writes the last access of each blob into its record in the
// index, unless the record is gone (evicted meanwhile) or holds a later one.
// It changes nothing else of the record: a pin or chunk hashes written since
// the caller looked stay as they are.
func saveAccess(tx *bolt.Tx, last map[digest.Digest]time.Time) error {
	b := tx.Bucket(bucketBlobs)
	for d, at := range last {
		v := b.Get([]byte(d.Encoded()))
		if v == nil {
			continue // evicted meanwhile
		}
		var r record
		if err := json.Unmarshal(v, &r); err != nil {
			return fmt.Errorf("index record of %s: %w", d, err)
		}
		if !r.LastAccess.Before(at) {
			continue
		}
		r.LastAccess = at
		if err := putRecord(b, d, &r); err != nil {
			return err
		}
	}
	return nil
}
