package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
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
	if err := os.Chmod(tmp, 0o755); err != nil {
		os.RemoveAll(tmp)
		return "", err
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
		if err := WriteFileAtomic(filepath.Join(refs, m.Revision), []byte(m.Revision), 0o644); err != nil {
			return "", err
		}
	}
	rec := modelRecord{Dir: mustRel(s.root, final)}
	for _, f := range m.Files {
		rec.Digest = append(rec.Digest, f.Digest)
	}
	if err := s.db.Update(func(tx *bolt.Tx) error {
		v, err := json.Marshal(rec)
		if err != nil {
			return err
		}
		return tx.Bucket(bucketModels).Put([]byte(m.Name+"@"+m.Revision), v)
	}); err != nil {
		return "", fmt.Errorf("indexing model %s@%s: %w", m.Name, m.Revision, err)
	}
	s.touchAll(rec.Digest)
	return final, nil
}

// linkFiles creates, under dir, one relative symlink per file pointing at its
// blob as seen from final (where dir will be renamed to), and fsyncs every
// directory it made.
func (s *Store) linkFiles(dir, final string, files []File) error {
	dirs := []string{dir}
	for _, f := range files {
		rel := filepath.FromSlash(f.Path)
		parent := filepath.Dir(filepath.Join(dir, rel))
		if parent != dir {
			if _, err := os.Stat(parent); errors.Is(err, os.ErrNotExist) {
				if err := os.MkdirAll(parent, 0o755); err != nil {
					return diskErr(err)
				}
				for p := parent; p != dir && !slices.Contains(dirs, p); p = filepath.Dir(p) {
					dirs = append(dirs, p)
				}
			}
		}
		blob, _ := s.BlobPath(f.Digest)
		target, err := filepath.Rel(filepath.Dir(filepath.Join(final, rel)), blob)
		if err != nil {
			return err
		}
		if err := os.Symlink(target, filepath.Join(dir, rel)); err != nil {
			return diskErr(err)
		}
	}
	for _, d := range dirs {
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
		}
		return nil
	})
}

// touchAll records an access to each blob in one index write.
func (s *Store) touchAll(ds []digest.Digest) {
	now := time.Now()
	updated := make(map[digest.Digest]*record, len(ds))
	s.mu.Lock()
	for _, d := range ds {
		if r, ok := s.blobs[d]; ok {
			next := *r
			next.LastAccess = now
			s.blobs[d] = &next
			updated[d] = &next
		}
	}
	s.mu.Unlock()
	if err := s.db.Batch(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketBlobs)
		for d, r := range updated {
			if b.Get([]byte(d.Encoded())) == nil {
				continue // evicted meanwhile
			}
			if err := putRecord(b, d, r); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		s.log.Warn("recording blob access", "err", err)
	}
}

func mustRel(base, target string) string {
	rel, err := filepath.Rel(base, target)
	if err != nil {
		panic(err) // both are absolute paths under the root
	}
	return rel
}
