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
	"slices"
	"strings"

	"github.com/opencontainers/go-digest"
	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/weightd/weightd/pkg/content"
)

// ModelDir is where the snapshot of model name at revision rev is (or would
// be) materialised: models/models--org--name/snapshots/<rev>, the layout of
// the Hugging Face hub cache, so HF_HUB_CACHE=<root>/models finds it.
func (s *Store) ModelDir(name, rev string) (string, error) {
	m := content.Model{Name: name, Revision: rev}
	if err := m.Validate(); err != nil {
		return "", err
	}
	return filepath.Join(s.repoDir(name), "snapshots", rev), nil
}

func (s *Store) repoDir(name string) string {
	return filepath.Join(modelsDir(s.root), "models--"+strings.ReplaceAll(name, "/", "--"))
}

// LinkedBlob returns the blob a snapshot entry's symlink target names
// (…/blobs/sha256/<hex>, as Materialize writes them); ok is false for any
// other target.
func LinkedBlob(target string) (d digest.Digest, ok bool) {
	parent, encoded := filepath.Split(filepath.Clean(target))
	if !strings.HasSuffix(filepath.Clean(parent), filepath.Join("blobs", "sha256")) {
		return "", false
	}
	d, err := content.ParseDigest("sha256:" + encoded)
	return d, err == nil
}

// Materialize lays out model m as a directory of relative symlinks into
// blobs/ and returns the directory. Every blob must already be in the store.
// It copies no bytes: its cost is O(files). The directory appears whole or not
// at all.
//
// A name and revision name one set of files for good: a snapshot that holds
// other files than m's is never replaced, and Materialize fails with
// ErrSnapshotConflict (a source whose content moves on names it with a new
// revision, and moves a ref). Only a snapshot of m itself is laid out again,
// atomically: one damaged since (what the index recorded there is m), or
// one whose index record was lost (it holds exactly m's files).
//
// Then it writes m's refs as huggingface_hub does
// (_cache_commit_hash_for_specific_revision): refs/<m.Ref> holding the
// revision, 40 hex digits and no newline, replacing what the ref held
// before (a branch moves on; the older snapshot stays). A revision that is
// not a commit (sources without commits) also gets refs/<revision> holding
// itself: the hub's offline download looks a revision that is not a commit
// up in refs/ only. The refs directory is made even when it stays empty:
// huggingface.js's scanCachedRepo needs it.
//
// A snapshot that is already exactly what Materialize would write (see
// snapshotIntact) is left as it is, and so is a ref that already holds the
// revision: materialising a cached model again writes nothing, bar the
// blobs' access times.
func (s *Store) Materialize(m content.Model) (string, error) {
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
			return "", fmt.Errorf("materialising %s@%s: file %q (%s): %w", m.Name, m.Revision, f.Path, f.Digest, content.ErrNotFound)
		}
	}
	s.mu.RUnlock()

	snapshots := filepath.Join(s.repoDir(m.Name), "snapshots")
	final := filepath.Join(snapshots, m.Revision)
	key := m.Name + "@" + m.Revision
	rec := snapshotRecord{modelRecord: modelRecord{Dir: mustRel(s.root, final)}, Paths: make([]string, 0, len(m.Files))}
	for _, f := range m.Files {
		rec.Digest = append(rec.Digest, f.Digest)
		rec.Paths = append(rec.Paths, f.Path)
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
		if err := s.writeRefs(m); err != nil {
			return "", fmt.Errorf("materialising %s@%s: %w", m.Name, m.Revision, err)
		}
		s.touchAll(rec.Digest)
		return final, nil
	}
	if err := s.mayLayOut(m, final, key); err != nil {
		return "", fmt.Errorf("materialising %s@%s: %w", m.Name, m.Revision, err)
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
	if err := s.writeRefs(m); err != nil {
		return "", fmt.Errorf("materialising %s@%s: %w", m.Name, m.Revision, err)
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

// snapshotRecord is the index record of a snapshot (under "name@revision"):
// the modelRecord that pruning reads, and the path of each file, so that
// what the snapshot holds is known whole. Records written before paths were
// kept have none.
type snapshotRecord struct {
	modelRecord
	Paths []string `json:"paths,omitempty"`
}

// mayLayOut checks that laying model m out at final replaces nothing but a
// snapshot of m: there is none, or it holds exactly m's files (its index
// record was lost), or the index records m there (it was damaged since).
// Anything else there is another model's snapshot under m's name and
// revision: ErrSnapshotConflict. modelsMu is held.
func (s *Store) mayLayOut(m content.Model, final, key string) error {
	if _, err := os.Lstat(final); errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return diskErr(err)
	}
	if s.snapshotHolds(m, final, false) || s.recorded(m, key) {
		return nil
	}
	return fmt.Errorf("%w: %s holds other files", ErrSnapshotConflict, mustRel(s.root, final))
}

// recorded reports whether the index record under key is of model m: the
// same file at each path, or, in a record from before paths were kept, the
// same blobs in the same order.
func (s *Store) recorded(m content.Model, key string) bool {
	var rec snapshotRecord
	var found bool
	_ = s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketModels).Get([]byte(key))
		found = v != nil && json.Unmarshal(v, &rec) == nil
		return nil
	})
	if !found || len(rec.Digest) != len(m.Files) {
		return false
	}
	if rec.Paths == nil {
		for i, f := range m.Files {
			if rec.Digest[i] != f.Digest {
				return false
			}
		}
		return true
	}
	if len(rec.Paths) != len(rec.Digest) {
		return false
	}
	want := make(map[string]digest.Digest, len(m.Files))
	for _, f := range m.Files {
		want[f.Path] = f.Digest
	}
	for i, p := range rec.Paths {
		if d, ok := want[p]; !ok || d != rec.Digest[i] {
			return false
		}
		delete(want, p) // a path recorded twice does not count twice
	}
	return len(want) == 0
}

// Modes of what Materialize writes, which snapshotIntact and refIntact
// expect.
const (
	snapshotDirPerm os.FileMode = 0o755
	refsDirPerm     os.FileMode = 0o755
	refPerm         os.FileMode = 0o644
)

// modelRefs lists the refs Materialize writes for m, each → the revision
// it holds: m.Ref, and the revision itself when it is not a commit.
func modelRefs(m content.Model) map[string]string {
	refs := make(map[string]string, 2)
	if m.Ref != "" {
		refs[m.Ref] = m.Revision
	}
	if !content.IsCommit(m.Revision) {
		refs[m.Revision] = m.Revision
	}
	return refs
}

// writeRefs makes the refs directory of model m and points each of m's refs
// at its revision, writing (atomically, synced) only those that hold
// anything else. modelsMu is held.
func (s *Store) writeRefs(m content.Model) error {
	repo := s.repoDir(m.Name)
	refsDir := filepath.Join(repo, "refs")
	if err := mkdirSynced(repo, refsDir, refsDirPerm); err != nil {
		return err
	}
	for name, rev := range modelRefs(m) {
		p := filepath.Join(refsDir, filepath.FromSlash(name))
		if refIntact(p, rev) {
			continue
		}
		if err := mkdirSynced(refsDir, filepath.Dir(p), refsDirPerm); err != nil {
			return err
		}
		if err := WriteFileAtomic(p, []byte(rev), refPerm); err != nil {
			return fmt.Errorf("writing ref %s: %w", name, err)
		}
	}
	return nil
}

// refIntact reports whether the ref file at p is what writeRefs writes for
// revision rev: a regular file of mode refPerm holding exactly rev.
func refIntact(p, rev string) bool {
	info, err := os.Lstat(p)
	if err != nil || !info.Mode().IsRegular() || info.Mode().Perm() != refPerm || info.Size() != int64(len(rev)) {
		return false
	}
	b, err := os.ReadFile(p)
	return err == nil && string(b) == rev
}

// mkdirSynced makes dir and its missing parents up from base (which must
// exist), each with mode perm, syncing the parent of each one it makes so
// that it survives a crash. A dir that is there already is left alone.
func mkdirSynced(base, dir string, perm os.FileMode) error {
	if info, err := os.Stat(dir); err == nil && info.IsDir() {
		return nil
	}
	rel, err := filepath.Rel(base, dir)
	if err != nil || !filepath.IsLocal(rel) {
		return fmt.Errorf("%w: directory %s is not under %s", content.ErrInvalid, dir, base)
	}
	p := base
	for seg := range strings.SplitSeq(rel, string(filepath.Separator)) {
		p = filepath.Join(p, seg)
		err := os.Mkdir(p, perm)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return diskErr(err)
		}
		if err := os.Chmod(p, perm); err != nil { // the umask
			return err
		}
		if err := SyncDir(filepath.Dir(p)); err != nil {
			return err
		}
	}
	return nil
}

// snapshotIntact reports whether model m is materialised at final exactly as
// Materialize would write it: its index record under key is recJSON, and the
// directory holds one relative symlink per file, pointing at the file's blob,
// and nothing else: no other file, link or directory, no directory that is
// a link, every directory with the mode Materialize gives it. Anything else
// (a half-written snapshot, a retargeted link, an extra or missing file) is
// not intact, and is laid out again if it is m's (mayLayOut). Refs are no
// part of it: writeRefs checks and mends them on their own. modelsMu is
// held.
func (s *Store) snapshotIntact(m content.Model, final, key string, recJSON []byte) bool {
	var indexed bool
	_ = s.db.View(func(tx *bolt.Tx) error {
		indexed = bytes.Equal(tx.Bucket(bucketModels).Get([]byte(key)), recJSON)
		return nil
	})
	return indexed && s.snapshotHolds(m, final, true)
}

// snapshotHolds reports whether the directory final holds exactly the
// links Materialize makes for model m, one per file to its blob, and the
// directories they are in, nothing else; with modes, every directory also
// has the mode Materialize gives it.
func (s *Store) snapshotHolds(m content.Model, final string, modes bool) bool {
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
	if err != nil || !info.IsDir() || modes && info.Mode().Perm() != snapshotDirPerm {
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
				if info, err := e.Info(); err != nil || modes && info.Mode().Perm() != snapshotDirPerm || !walk(rel) {
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
// snapshots directory holding it, and the refs directory and those holding
// m's refs (found there, the ref files themselves were synced when written).
func (s *Store) syncSnapshot(m content.Model, final string) error {
	dirs := []string{final, filepath.Dir(final)}
	for _, f := range m.Files {
		for d := path.Dir(f.Path); d != "."; d = path.Dir(d) {
			if p := filepath.Join(final, filepath.FromSlash(d)); !slices.Contains(dirs, p) {
				dirs = append(dirs, p)
			}
		}
	}
	refsDir := filepath.Join(s.repoDir(m.Name), "refs")
	for name := range modelRefs(m) {
		for d := path.Dir(name); ; d = path.Dir(d) {
			if p := filepath.Join(refsDir, filepath.FromSlash(d)); !slices.Contains(dirs, p) {
				dirs = append(dirs, p)
			}
			if d == "." {
				break
			}
		}
	}
	for _, d := range dirs {
		if err := SyncDir(d); errors.Is(err, fs.ErrNotExist) && strings.HasPrefix(d, refsDir) {
			continue // writeRefs makes it next
		} else if err != nil {
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
func (s *Store) linkFiles(dir, final string, files []content.File) error {
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

func mustRel(base, target string) string {
	rel, err := filepath.Rel(base, target)
	if err != nil {
		panic(err) // both are absolute paths under the root
	}
	return rel
}
