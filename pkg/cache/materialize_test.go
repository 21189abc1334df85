package cache

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"
)

// snapshotFixture is a store holding the blobs of a small model with a file
// in a subdirectory, on a branch (so with a ref), and a spare blob that is
// no file of it.
type snapshotFixture struct {
	s     *Store
	m     Model
	files map[string][]byte
	spare Descriptor
}

func newSnapshotFixture(t *testing.T, opts ...Option) *snapshotFixture {
	t.Helper()
	f := &snapshotFixture{
		s: openStore(t, t.TempDir(), opts...),
		m: Model{Name: "org/tiny", Revision: "main"},
		files: map[string][]byte{
			"config.json":              []byte(`{"model_type":"llama"}`),
			"model.safetensors":        randomBytes(90, 100<<10),
			"tokenizer/tokenizer.json": []byte(`{"v":1}`),
		},
	}
	for _, p := range []string{"config.json", "model.safetensors", "tokenizer/tokenizer.json"} {
		b := f.files[p]
		_, err := f.s.Fetch(context.Background(), descOf(b), &memSource{data: b}, nil)
		require.NoError(t, err)
		f.m.Files = append(f.m.Files, File{Path: p, Descriptor: descOf(b)})
	}
	spare := []byte("not a file of the model")
	_, err := f.s.Fetch(context.Background(), descOf(spare), &memSource{data: spare}, nil)
	require.NoError(t, err)
	f.spare = descOf(spare)
	return f
}

// requireSnapshot checks that dir is exactly the model's snapshot: a link
// per file, relative, reading the file's bytes, nothing else; the ref names
// the revision; the index record lists the model's blobs.
func (f *snapshotFixture) requireSnapshot(t *testing.T, dir string) {
	t.Helper()
	var found []string
	require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		require.NoError(t, err)
		rel, _ := filepath.Rel(dir, p)
		switch {
		case d.IsDir():
			info, err := d.Info()
			require.NoError(t, err)
			require.Equal(t, snapshotDirPerm, info.Mode().Perm(), "mode of %s", rel)
		case d.Type() == os.ModeSymlink:
			target, err := os.Readlink(p)
			require.NoError(t, err)
			require.False(t, filepath.IsAbs(target))
			want, ok := f.files[filepath.ToSlash(rel)]
			require.True(t, ok, "unexpected link %s", rel)
			got, err := os.ReadFile(p)
			require.NoError(t, err)
			require.True(t, bytes.Equal(want, got), "content of %s", rel)
			found = append(found, filepath.ToSlash(rel))
		default:
			t.Fatalf("unexpected %v %s in the snapshot", d.Type(), rel)
		}
		return nil
	}))
	require.Len(t, found, len(f.files))
	ref, err := os.ReadFile(filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Revision))
	require.NoError(t, err)
	require.Equal(t, f.m.Revision, string(ref))
	var rec modelRecord
	require.NoError(t, f.s.db.View(func(tx *bolt.Tx) error {
		return json.Unmarshal(tx.Bucket(bucketModels).Get([]byte(f.m.Name+"@"+f.m.Revision)), &rec)
	}))
	require.Equal(t, mustRel(f.s.Root(), dir), rec.Dir)
	require.Len(t, rec.Digest, len(f.files))
}

type fileID struct {
	ino   uint64
	mtime time.Time
}

func idOf(t *testing.T, p string) fileID {
	t.Helper()
	info, err := os.Lstat(p)
	require.NoError(t, err)
	return fileID{ino: info.Sys().(*syscall.Stat_t).Ino, mtime: info.ModTime()}
}

func TestMaterializeLeavesIntactSnapshotAlone(t *testing.T) {
	t.Parallel()
	f := newSnapshotFixture(t)
	dir, err := f.s.Materialize(f.m)
	require.NoError(t, err)
	f.requireSnapshot(t, dir)
	paths := []string{
		dir, filepath.Dir(dir), filepath.Join(dir, "config.json"), filepath.Join(dir, "tokenizer"),
		filepath.Join(dir, "tokenizer", "tokenizer.json"), filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Revision),
	}
	before := make(map[string]fileID)
	for _, p := range paths {
		before[p] = idOf(t, p)
	}
	accessed := f.s.List()[0].LastAccess
	time.Sleep(10 * time.Millisecond) // an mtime would move on

	dir2, err := f.s.Materialize(f.m)
	require.NoError(t, err)
	require.Equal(t, dir, dir2)
	for _, p := range paths {
		require.Equal(t, before[p], idOf(t, p), "%s was written again", p)
	}
	f.requireSnapshot(t, dir)
	info, err := f.s.Stat(f.m.Files[0].Digest)
	require.NoError(t, err)
	require.True(t, info.LastAccess.After(accessed), "materialising again still counts as a use of the blobs")

	// Another process finds it intact too (the index says so).
	require.NoError(t, f.s.Close())
	s2 := openStore(t, f.s.Root())
	dir3, err := s2.Materialize(f.m)
	require.NoError(t, err)
	require.Equal(t, dir, dir3)
	for _, p := range paths {
		require.Equal(t, before[p], idOf(t, p), "%s was written again after a restart", p)
	}
	require.True(t, s2.synced[f.m.Name+"@"+f.m.Revision], "a snapshot found intact is synced once")

	// A commit revision has no ref, and is left alone all the same.
	m := f.m
	m.Revision = "0123456789abcdef0123456789abcdef01234567"
	cdir, err := s2.Materialize(m)
	require.NoError(t, err)
	id := idOf(t, cdir)
	_, err = s2.Materialize(m)
	require.NoError(t, err)
	require.Equal(t, id, idOf(t, cdir))
}

func TestMaterializeRebuildsTamperedSnapshot(t *testing.T) {
	t.Parallel()
	for name, tamper := range map[string]func(t *testing.T, f *snapshotFixture, dir string){
		"link retargeted to another blob": func(t *testing.T, f *snapshotFixture, dir string) {
			p := filepath.Join(dir, "config.json")
			blob, _ := f.s.BlobPath(f.spare.Digest)
			target, _ := filepath.Rel(dir, blob)
			require.NoError(t, os.Remove(p))
			require.NoError(t, os.Symlink(target, p))
		},
		"link made absolute": func(t *testing.T, f *snapshotFixture, dir string) {
			p := filepath.Join(dir, "config.json")
			blob, _ := f.s.BlobPath(f.m.Files[0].Digest)
			require.NoError(t, os.Remove(p))
			require.NoError(t, os.Symlink(blob, p))
		},
		"link dangling": func(t *testing.T, f *snapshotFixture, dir string) {
			p := filepath.Join(dir, "tokenizer", "tokenizer.json")
			require.NoError(t, os.Remove(p))
			require.NoError(t, os.Symlink("../nowhere", p))
		},
		"link replaced by a copy": func(t *testing.T, f *snapshotFixture, dir string) {
			p := filepath.Join(dir, "config.json")
			require.NoError(t, os.Remove(p))
			require.NoError(t, os.WriteFile(p, f.files["config.json"], 0o644))
		},
		"file missing": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, "model.safetensors")))
		},
		"subdirectory missing": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.RemoveAll(filepath.Join(dir, "tokenizer")))
		},
		"extra file": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "extra.txt"), []byte("x"), 0o644))
		},
		"extra link in a subdirectory": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.Symlink("../config.json", filepath.Join(dir, "tokenizer", "extra.json")))
		},
		"extra directory": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.Mkdir(filepath.Join(dir, "empty"), 0o755))
		},
		"subdirectory replaced by a link": func(t *testing.T, f *snapshotFixture, dir string) {
			elsewhere := filepath.Join(filepath.Dir(dir), "elsewhere")
			require.NoError(t, os.Rename(filepath.Join(dir, "tokenizer"), elsewhere))
			require.NoError(t, os.Symlink("../elsewhere", filepath.Join(dir, "tokenizer")))
		},
		"mode changed": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.Chmod(dir, 0o777))
		},
		"snapshot removed": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.RemoveAll(dir))
		},
		"snapshot replaced by a link": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.Rename(dir, dir+"-moved"))
			require.NoError(t, os.Symlink(filepath.Base(dir)+"-moved", dir))
		},
		"ref rewritten": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Revision), []byte("mai"), 0o644))
		},
		"ref missing": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, os.Remove(filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Revision)))
		},
		"index record missing": func(t *testing.T, f *snapshotFixture, dir string) {
			require.NoError(t, f.s.db.Update(func(tx *bolt.Tx) error {
				return tx.Bucket(bucketModels).Delete([]byte(f.m.Name + "@" + f.m.Revision))
			}))
		},
		"index record of other blobs": func(t *testing.T, f *snapshotFixture, dir string) {
			rec, err := json.Marshal(modelRecord{Dir: mustRel(f.s.Root(), dir), Digest: []digest.Digest{f.spare.Digest}})
			require.NoError(t, err)
			require.NoError(t, f.s.db.Update(func(tx *bolt.Tx) error {
				return tx.Bucket(bucketModels).Put([]byte(f.m.Name+"@"+f.m.Revision), rec)
			}))
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newSnapshotFixture(t)
			dir, err := f.s.Materialize(f.m)
			require.NoError(t, err)
			tamper(t, f, dir)
			key := f.m.Name + "@" + f.m.Revision
			rec, err := json.Marshal(modelRecord{Dir: mustRel(f.s.Root(), dir), Digest: []digest.Digest{
				f.m.Files[0].Digest, f.m.Files[1].Digest, f.m.Files[2].Digest,
			}})
			require.NoError(t, err)
			require.False(t, f.s.snapshotIntact(f.m, dir, key, rec), "tampered snapshot taken for intact")

			dir2, err := f.s.Materialize(f.m)
			require.NoError(t, err)
			require.Equal(t, dir, dir2)
			f.requireSnapshot(t, dir)
			require.True(t, f.s.snapshotIntact(f.m, dir, key, rec), "rebuilt snapshot not intact")
			leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), ".tmp-*"))
			require.Empty(t, leftovers)
		})
	}
}

// A different file list for the same revision is not the snapshot on disk:
// it is laid out again, whole.
func TestMaterializeChangedModelReplacesSnapshot(t *testing.T) {
	t.Parallel()
	f := newSnapshotFixture(t)
	dir, err := f.s.Materialize(f.m)
	require.NoError(t, err)
	for name, files := range map[string][]File{
		"fewer files":   f.m.Files[:2],
		"renamed file":  {f.m.Files[0], {Path: "weights.safetensors", Descriptor: f.m.Files[1].Descriptor}, f.m.Files[2]},
		"other content": {{Path: "config.json", Descriptor: f.spare}, f.m.Files[1], f.m.Files[2]},
	} {
		m := f.m
		m.Files = files
		before := idOf(t, dir)
		_, err := f.s.Materialize(m)
		require.NoError(t, err, name)
		require.NotEqual(t, before, idOf(t, dir), "%s: snapshot not replaced", name)
		entries := 0
		require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if d.Type() == os.ModeSymlink {
				entries++
			}
			return err
		}))
		require.Equal(t, len(files), entries, name)

		_, err = f.s.Materialize(f.m) // back to the original
		require.NoError(t, err)
		f.requireSnapshot(t, dir)
	}
}

func TestTouchWritesIndexAtGranularity(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	s := openStore(t, root, withAccessGranularity(time.Hour))
	data := randomBytes(95, 10<<10)
	d := descOf(data).Digest
	_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)
	indexed := func(s *Store) time.Time {
		var r record
		require.NoError(t, s.db.View(func(tx *bolt.Tx) error {
			return json.Unmarshal(tx.Bucket(bucketBlobs).Get([]byte(d.Encoded())), &r)
		}))
		return r.LastAccess
	}
	committed := indexed(s)

	time.Sleep(5 * time.Millisecond)
	f, err := s.Open(d)
	require.NoError(t, err)
	f.Close()
	info, err := s.Stat(d)
	require.NoError(t, err)
	require.True(t, info.LastAccess.After(committed), "the access is recorded in memory")
	require.Never(t, func() bool { return !indexed(s).Equal(committed) }, 100*time.Millisecond, 5*time.Millisecond,
		"an access within the granularity is not written")

	// Close writes it.
	last := info.LastAccess
	require.NoError(t, s.Close())
	s2 := openStore(t, root, withAccessGranularity(0))
	info, err = s2.Stat(d)
	require.NoError(t, err)
	require.True(t, info.LastAccess.Equal(last), "Close writes the last access: %v, want %v", info.LastAccess, last)

	// With no granularity, every access is written (behind the caller).
	_, err = s2.Fetch(context.Background(), descOf(data), nil, nil)
	require.NoError(t, err)
	info, err = s2.Stat(d)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return indexed(s2).Equal(info.LastAccess) }, 5*time.Second, time.Millisecond)
}

// Eviction follows the accesses in memory, written to the index or not.
func TestEvictionFollowsAccessesNotYetWritten(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir(), WithBudget(3*100<<10, 0), withAccessGranularity(time.Hour))
	blobs := make([][]byte, 4)
	for i := range blobs {
		blobs[i] = randomBytes(uint64(96+i), 100<<10)
	}
	for _, b := range blobs[:3] {
		_, err := s.Fetch(context.Background(), descOf(b), &memSource{data: b}, nil)
		require.NoError(t, err)
		time.Sleep(2 * time.Millisecond)
	}
	f, err := s.Open(descOf(blobs[0]).Digest) // blobs[1] is now the least recently used
	require.NoError(t, err)
	f.Close()
	_, err = s.Fetch(context.Background(), descOf(blobs[3]), &memSource{data: blobs[3]}, nil)
	require.NoError(t, err)
	_, err = s.Stat(descOf(blobs[1]).Digest)
	require.ErrorIs(t, err, ErrNotFound)
	_, err = s.Stat(descOf(blobs[0]).Digest)
	require.NoError(t, err, "a blob used recently is kept")
}

// saveAccess changes only the last access of a record, never moving it back:
// a pin written since the toucher looked is kept.
func TestSaveAccessKeepsTheRestOfTheRecord(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(99, 1000)
	d := descOf(data).Digest
	_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)
	require.NoError(t, s.Pin(d, "pod:a"))
	read := func() record {
		var r record
		require.NoError(t, s.db.View(func(tx *bolt.Tx) error {
			return json.Unmarshal(tx.Bucket(bucketBlobs).Get([]byte(d.Encoded())), &r)
		}))
		return r
	}
	pinned := read()
	later := pinned.LastAccess.Add(time.Minute)
	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error { return saveAccess(tx, map[digest.Digest]time.Time{d: later}) }))
	got := read()
	require.True(t, got.LastAccess.Equal(later))
	require.Contains(t, got.Pins, "pod:a")
	require.Equal(t, pinned.Chunks, got.Chunks)

	require.NoError(t, s.db.Update(func(tx *bolt.Tx) error {
		return saveAccess(tx, map[digest.Digest]time.Time{d: later.Add(-time.Hour)})
	}))
	require.True(t, read().LastAccess.Equal(later), "an older access does not move the record back")
}
