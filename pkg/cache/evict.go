package cache

import (
	"fmt"
	"os"
	"time"

	"github.com/opencontainers/go-digest"
	bolt "go.etcd.io/bbolt"
)

// budget returns the bytes the store may occupy and the bytes free on its
// filesystem.
func (s *Store) budget() (budget, free int64, err error) {
	total, free, err := fsSpace(s.root)
	if err != nil {
		return 0, 0, err
	}
	budget = total
	if s.opts.budgetPercent > 0 {
		budget = int64(float64(total) * s.opts.budgetPercent / 100)
	}
	if s.opts.budgetBytes > 0 {
		budget = min(budget, s.opts.budgetBytes)
	}
	s.m.budgetBytes.Set(float64(budget))
	return budget, free, nil
}

// reserve makes room for desc under the budget, evicting least recently used
// blobs and idle partial downloads if needed, and returns the partial data
// file, allocated to its full size. A blob that cannot fit is ErrDiskFull.
func (s *Store) reserve(desc Descriptor) (*os.File, error) {
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

// makeRoom evicts until need more bytes fit under the budget and on the disk.
// evictMu must be held. The blob being reserved (self) is never a candidate.
func (s *Store) makeRoom(need int64, self digest.Digest) error {
	for {
		budget, free, err := s.budget()
		if err != nil {
			return err
		}
		s.mu.RLock()
		stored, partial := s.bytesLocked()
		s.mu.RUnlock()
		used := stored + partial
		if used <= budget && need <= free {
			return nil
		}
		victim, isPartial, ok := s.lruCandidate(self)
		if !ok {
			return fmt.Errorf("%w: need %d bytes for %s: budget %d, in use %d (pinned or downloading), %d free on disk",
				ErrDiskFull, need, self, budget, used, free)
		}
		if err := s.evict(victim, isPartial); err != nil {
			return err
		}
	}
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
		s.modelsMu.Lock()
		defer s.modelsMu.Unlock()
		s.mu.Lock()
		r, ok := s.blobs[d]
		if !ok || len(r.Pins) > 0 || s.holds[d] > 0 {
			s.mu.Unlock()
			return nil // gone, pinned or held since it was picked
		}
		delete(s.blobs, d)
		s.mu.Unlock()
		size = r.Size
		if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketBlobs).Delete([]byte(d.Encoded())) }); err != nil {
			return fmt.Errorf("evicting %s: %w", d, err)
		}
		p, _ := s.BlobPath(d)
		if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("evicting %s: %w", d, err)
		}
		if err := s.pruneModelsLocked(); err != nil {
			return err
		}
	}
	if !isPartial {
		s.emit(Event{Kind: EventRemoved, Digest: d})
	}
	s.log.Info("evicted", "digest", d, "bytes", size, "partial", isPartial)
	s.m.evictions.Inc()
	s.m.evictedBytes.Add(float64(size))
	s.updateGauges()
	return nil
}

func (s *Store) putBlob(d digest.Digest, r *record) error {
	return s.db.Update(func(tx *bolt.Tx) error { return putRecord(tx.Bucket(bucketBlobs), d, r) })
}
