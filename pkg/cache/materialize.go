package cache

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"
)

var commitRE = regexp.MustCompile(`^[0-9a-f]{40}$`)

// ModelDir is where the snapshot of model name at revision rev is (or would
// be) materialised: models/models--org--name/snapshots/<rev>, the layout of
// the Hugging Face hub cache, so HF_HUB_CACHE=<root>/models finds it.
func (s *Store) ModelDir(name, rev string) (string, error) {
	m := Model{Name: name, Revision: rev}
	if err := m.Validate(); err != nil {
		return "", err
	}
	return filepath.Join(s.repoDir(name), "snapshots", rev), nil
}

func (s *Store) repoDir(name string) string {
	return filepath.Join(modelsDir(s.root), "models--"+strings.ReplaceAll(name, "/", "--"))
}

// Materialize lays out model m as a directory of relative symlinks into
// blobs/ and returns the directory. Every blob must already be in the store.
// It copies no bytes: its cost is O(files). The directory appears whole or not
// at all; materialising again replaces it atomically.
//
// A snapshot that is already exactly what Materialize would write (see
// snapshotIntact) is left as it is: materialising a cached model again
// writes nothing, bar the blobs' access times.
func (s *Store) Materialize(m Model) (string, error) {
	if err := m.Validate(); err != nil {
		return "", err
	}
	s.modelsMu.Lock()
	defer s.modelsMu.Unlock()
	s.mu.RLock()
	for _, f := range m.Files {
		r, ok := s.blobs[f.Digest]
		if !ok || r.Size != f.Size {
			s.mu.RUnlock()
			return "", fmt.Errorf("materialising %s@%s: file %q (%s): %w", m.Name, m.Revision, f.Path, f.Digest, ErrNotFound)
		}
	}
	s.mu.RUnlock()

	snapshots := filepath.Join(s.repoDir(m.Name), "snapshots")
	final := filepath.Join(snapshots, m.Revision)
	key := m.Name + "@" + m.Revision
	rec := modelRecord{Dir: mustRel(s.root, final)}
	for _, f := range m.Files {
		rec.Digest = append(rec.Digest, f.Digest)
	}
	recJSON, err := json.Marshal(rec)
	if err != nil {
		return "", err
	}
	if s.snapshotIntact(m, final, key, recJSON) {
		if !s.synced[key] {
			// Written by an earlier process, which may have died between
			// laying it out and syncing it: sync it before saying it is there.
			if err := s.syncSnapshot(m, final); err != nil {
				return "", fmt.Errorf("materialising %s@%s: %w", m.Name, m.Revision, err)
			}
			s.synced[key] = true
		}
		s.touchAll(rec.Digest)
		return final, nil
	}
	delete(s.synced, key)

	if err := os.MkdirAll(snapshots, 0o755); err != nil {
		return "", diskErr(err)
	}
	tmp, err := os.MkdirTemp(snapshots, ".tmp-")
	if err != nil {
		return "", diskErr(err)
	}
	if err := s.linkFiles(tmp, final, m.Files); err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("materialising %s@%s: %w", m.Name, m.Revision, err)
	}
	// Swap the new snapshot in atomically; the old one (if any) ends up in tmp.
	err = unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, final, unix.RENAME_EXCHANGE)
	if errors.Is(err, unix.ENOENT) {
		err = os.Rename(tmp, final)
	}
	if err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("materialising %s@%s: %w", m.Name, m.Revision, diskErr(err))
	}
	os.RemoveAll(tmp)
	if err := SyncDir(snapshots); err != nil {
		return "", err
	}
	if !commitRE.MatchString(m.Revision) {
		// The hub resolves a branch or tag through refs/<name> to a snapshot.
		refs := filepath.Join(s.repoDir(m.Name), "refs")
		if err := os.MkdirAll(refs, 0o755); err != nil {
			return "", diskErr(err)
		}
		if err := WriteFileAtomic(filepath.Join(refs, m.Revision), []byte(m.Revision), refPerm); err != nil {
			return "", err
		}
	}
	if err := s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketModels).Put([]byte(key), recJSON)
	}); err != nil {
		return "", fmt.Errorf("indexing model %s@%s: %w", m.Name, m.Revision, err)
	}
	s.synced[key] = true
	s.touchAll(rec.Digest)
	return final, nil
}

// Modes of what Materialize writes, which snapshotIntact expects.
const (
	snapshotDirPerm os.FileMode = 0o755
	refPerm         os.FileMode = 0o644
)

// snapshotIntact reports whether model m is materialised at final exactly as
// Materialize would write it: its index record under key is recJSON, its ref
// (for a branch or tag) a regular file naming the revision, and the
// directory holds one relative symlink per file, pointing at the file's blob,
// and nothing else: no other file, link or directory, no directory that is
// a link, every directory with the mode Materialize gives it. Anything else
// (a half-written snapshot, a retargeted link, an extra or missing file) is
// not intact, and is laid out again. modelsMu is held.
func (s *Store) snapshotIntact(m Model, final, key string, recJSON []byte) bool {
	var indexed bool
	_ = s.db.View(func(tx *bolt.Tx) error {
		indexed = bytes.Equal(tx.Bucket(bucketModels).Get([]byte(key)), recJSON)
		return nil
	})
	if !indexed {
		return false
	}
	if !commitRE.MatchString(m.Revision) {
		ref := filepath.Join(s.repoDir(m.Name), "refs", m.Revision)
		info, err := os.Lstat(ref)
		if err != nil || !info.Mode().IsRegular() || info.Mode().Perm() != refPerm || info.Size() != int64(len(m.Revision)) {
			return false
		}
		if b, err := os.ReadFile(ref); err != nil || string(b) != m.Revision {
			return false
		}
	}
	want := make(map[string]string, len(m.Files)) // path under final → link target
	dirs := map[string]bool{".": true}
	for _, f := range m.Files {
		rel := filepath.FromSlash(f.Path)
		target, err := s.linkTarget(final, rel, f.Digest)
		if err != nil {
			return false
		}
		want[rel] = target
		for d := filepath.Dir(rel); d != "."; d = filepath.Dir(d) {
			dirs[d] = true
		}
	}
	info, err := os.Lstat(final)
	if err != nil || !info.IsDir() || info.Mode().Perm() != snapshotDirPerm {
		return false
	}
	links := 0
	var walk func(dir string) bool
	walk = func(dir string) bool {
		entries, err := os.ReadDir(filepath.Join(final, dir))
		if err != nil {
			return false
		}
		for _, e := range entries {
			rel := filepath.Join(dir, e.Name())
			switch e.Type() {
			case fs.ModeSymlink:
				target, ok := want[rel]
				if !ok {
					return false
				}
				if got, err := os.Readlink(filepath.Join(final, rel)); err != nil || got != target {
					return false
				}
				links++
			case fs.ModeDir:
				if !dirs[rel] {
					return false
				}
				if info, err := e.Info(); err != nil || info.Mode().Perm() != snapshotDirPerm || !walk(rel) {
					return false
				}
			default:
				return false
			}
		}
		return true
	}
	return walk(".") && links == len(want)
}

// syncSnapshot fsyncs every directory of model m's snapshot at final, the
// snapshots directory holding it and the directory of its refs.
func (s *Store) syncSnapshot(m Model, final string) error {
	dirs := []string{final, filepath.Dir(final)}
	for _, f := range m.Files {
		for d := path.Dir(f.Path); d != "."; d = path.Dir(d) {
			if p := filepath.Join(final, filepath.FromSlash(d)); !slices.Contains(dirs, p) {
				dirs = append(dirs, p)
			}
		}
	}
	if !commitRE.MatchString(m.Revision) {
		dirs = append(dirs, filepath.Join(s.repoDir(m.Name), "refs"))
	}
	for _, d := range dirs {
		if err := SyncDir(d); err != nil {
			return err
		}
	}
	return nil
}

// linkTarget is the relative target of the link at rel under final to blob d.
func (s *Store) linkTarget(final, rel string, d digest.Digest) (string, error) {
	blob, err := s.BlobPath(d)
	if err != nil {
		return "", err
	}
	return filepath.Rel(filepath.Dir(filepath.Join(final, rel)), blob)
}

// linkFiles creates, under dir, one relative symlink per file pointing at its
// blob as seen from final (where dir will be renamed to), gives every
// directory it made (dir too) the mode snapshotDirPerm and fsyncs them.
func (s *Store) linkFiles(dir, final string, files []File) error {
	dirs := []string{dir}
	for _, f := range files {
		rel := filepath.FromSlash(f.Path)
		parent := filepath.Dir(filepath.Join(dir, rel))
		if parent != dir {
			if _, err := os.Stat(parent); errors.Is(err, os.ErrNotExist) {
				if err := os.MkdirAll(parent, snapshotDirPerm); err != nil {
					return diskErr(err)
				}
				for p := parent; p != dir && !slices.Contains(dirs, p); p = filepath.Dir(p) {
					dirs = append(dirs, p)
				}
			}
		}
		target, err := s.linkTarget(final, rel, f.Digest)
		if err != nil {
			return err
		}
		if err := os.Symlink(target, filepath.Join(dir, rel)); err != nil {
			return diskErr(err)
		}
	}
	for _, d := range dirs {
		if err := os.Chmod(d, snapshotDirPerm); err != nil { // MkdirTemp's 0700, the umask
			return err
		}
		if err := SyncDir(d); err != nil {
			return err
		}
	}
	return nil
}

// pruneModels removes leftover temp snapshots and every snapshot that links to
// a blob no longer in the store.
func (s *Store) pruneModels() error {
	s.modelsMu.Lock()
	defer s.modelsMu.Unlock()
	tmps, _ := filepath.Glob(filepath.Join(modelsDir(s.root), "*", "snapshots", ".tmp-*"))
	for _, t := range tmps {
		os.RemoveAll(t)
	}
	return s.pruneModelsLocked()
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
				if err := os.RemoveAll(filepath.Join(s.root, rec.Dir)); err != nil {
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

func mustRel(base, target string) string {
	rel, err := filepath.Rel(base, target)
	if err != nil {
		panic(err) // both are absolute paths under the root
	}
	return rel
}
