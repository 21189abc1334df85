package cache

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"
	bolt "go.etcd.io/bbolt"

	"github.com/weightd/weightd/pkg/content"
)

// snapshotFixture is a store holding the blobs of a small model with a file
// in a subdirectory, at a commit resolved from a branch (so with a ref), and
// a spare blob that is no file of it.
type snapshotFixture struct {
	s     *Store
	m     content.Model
	files map[string][]byte
	spare content.Descriptor
}

func newSnapshotFixture(t *testing.T, opts ...Option) *snapshotFixture {
	t.Helper()
	f := &snapshotFixture{
		s: openStore(t, t.TempDir(), opts...),
		m: content.Model{Name: "org/tiny", Revision: "0123456789abcdef0123456789abcdef01234567", Ref: "main"},
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
		f.m.Files = append(f.m.Files, content.File{Path: p, Descriptor: descOf(b)})
	}
	spare := []byte("not a file of the model")
	_, err := f.s.Fetch(context.Background(), descOf(spare), &memSource{data: spare}, nil)
	require.NoError(t, err)
	f.spare = descOf(spare)
	return f
}

// requireSnapshot checks that dir is exactly the model's snapshot: a link
// per file, relative, reading the file's bytes, nothing else; the ref holds
// the revision (the commit), and nothing else is in refs/; the index record
// lists the model's blobs.
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
	ref, err := os.ReadFile(filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Ref))
	require.NoError(t, err)
	require.Equal(t, f.m.Revision, string(ref))
	refs, err := os.ReadDir(filepath.Join(f.s.repoDir(f.m.Name), "refs"))
	require.NoError(t, err)
	require.Len(t, refs, 1, "refs/ holds the branch's ref only")
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
		filepath.Join(dir, "tokenizer", "tokenizer.json"), filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Ref),
		filepath.Join(f.s.repoDir(f.m.Name), "refs"),
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

	// A commit revision without a ref, and a revision that is not a commit
	// (a source without commits: it refers to itself), are left alone all
	// the same.
	for _, m := range []content.Model{
		{Name: f.m.Name, Revision: "89abcdef0123456789abcdef0123456789abcdef", Files: f.m.Files},
		{Name: f.m.Name, Revision: "v2", Files: f.m.Files},
	} {
		cdir, err := s2.Materialize(m)
		require.NoError(t, err)
		ids := []fileID{idOf(t, cdir), idOf(t, filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Ref))}
		_, err = s2.Materialize(m)
		require.NoError(t, err)
		require.Equal(t, ids, []fileID{idOf(t, cdir), idOf(t, filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Ref))}, m.Revision)
	}
}

// Refs are checked and mended on their own: a ref that is missing or holds
// something else is written again, and the snapshot is left as it is.
func TestMaterializeMendsRefs(t *testing.T) {
	t.Parallel()
	ref := func(f *snapshotFixture) string { return filepath.Join(f.s.repoDir(f.m.Name), "refs", f.m.Ref) }
	for name, tamper := range map[string]func(t *testing.T, f *snapshotFixture){
		"ref holds the branch name": func(t *testing.T, f *snapshotFixture) {
			require.NoError(t, os.WriteFile(ref(f), []byte(f.m.Ref), refPerm))
		},
		"ref holds a newline too": func(t *testing.T, f *snapshotFixture) {
			require.NoError(t, os.WriteFile(ref(f), []byte(f.m.Revision+"\n"), refPerm))
		},
		"ref holds a shorter commit": func(t *testing.T, f *snapshotFixture) {
			require.NoError(t, os.WriteFile(ref(f), []byte(f.m.Revision[:12]), refPerm))
		},
		"ref missing": func(t *testing.T, f *snapshotFixture) {
			require.NoError(t, os.Remove(ref(f)))
		},
		"refs directory missing": func(t *testing.T, f *snapshotFixture) {
			require.NoError(t, os.RemoveAll(filepath.Dir(ref(f))))
		},
		"ref is a link": func(t *testing.T, f *snapshotFixture) {
			good := filepath.Join(t.TempDir(), "main") // reads right, but is no ref of ours
			require.NoError(t, os.Rename(ref(f), good))
			require.NoError(t, os.Symlink(good, ref(f)))
		},
		"ref mode changed": func(t *testing.T, f *snapshotFixture) {
			require.NoError(t, os.Chmod(ref(f), 0o600))
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f := newSnapshotFixture(t)
			dir, err := f.s.Materialize(f.m)
			require.NoError(t, err)
			snap := idOf(t, dir)
			tamper(t, f)
			dir2, err := f.s.Materialize(f.m)
			require.NoError(t, err)
			require.Equal(t, dir, dir2)
			require.Equal(t, snap, idOf(t, dir), "the snapshot was laid out again")
			f.requireSnapshot(t, dir)
			info, err := os.Lstat(ref(f))
			require.NoError(t, err)
			require.Equal(t, refPerm, info.Mode())
		})
	}
}

// A branch that moves on to another commit moves its ref; the older snapshot
// stays, and so does a tag of it. A ref is named by '/'-separated names
// ("refs/pr/1") as the hub names pull requests.
func TestMaterializeMovesRefs(t *testing.T) {
	t.Parallel()
	f := newSnapshotFixture(t)
	refs := filepath.Join(f.s.repoDir(f.m.Name), "refs")
	readRef := func(name string) string {
		b, err := os.ReadFile(filepath.Join(refs, filepath.FromSlash(name)))
		require.NoError(t, err, name)
		return string(b)
	}
	first := f.m
	_, err := f.s.Materialize(first)
	require.NoError(t, err)
	tag := first
	tag.Ref = "v1.0"
	_, err = f.s.Materialize(tag)
	require.NoError(t, err)

	second := first
	second.Revision = "fedcba9876543210fedcba9876543210fedcba98"
	second.Files = first.Files[:1]
	dir2, err := f.s.Materialize(second)
	require.NoError(t, err)
	require.Equal(t, second.Revision, readRef("main"))
	require.Equal(t, first.Revision, readRef("v1.0"))
	_, err = os.Stat(filepath.Join(filepath.Dir(dir2), first.Revision, "tokenizer", "tokenizer.json"))
	require.NoError(t, err, "the older snapshot stays")

	pr := second
	pr.Ref = "refs/pr/1"
	_, err = f.s.Materialize(pr)
	require.NoError(t, err)
	require.Equal(t, second.Revision, readRef("refs/pr/1"))
	info, err := os.Stat(filepath.Join(refs, "refs", "pr"))
	require.NoError(t, err)
	require.Equal(t, refsDirPerm, info.Mode().Perm())
}

func TestModelValidateRef(t *testing.T) {
	t.Parallel()
	m := content.Model{Name: "org/tiny", Revision: "0123456789abcdef0123456789abcdef01234567"}
	for _, ref := range []string{"main", "v1.0", "refs/pr/1", "release_2-x", "a/b/c", strings.Repeat("a", 255)} {
		m.Ref = ref
		require.NoError(t, m.Validate(), ref)
	}
	for _, ref := range []string{
		"/main", "main/", "a//b", ".hidden", "a/.b", "..", "a/../b", "./a", "a b", "a\\b", "a\x00",
		"0123456789abcdef0123456789abcdef01234567", strings.Repeat("a", 256), "ma:in", "main~1",
	} {
		m.Ref = ref
		require.ErrorIs(t, m.Validate(), content.ErrInvalid, "%q", ref)
	}
}

func TestMaterializeNotACommitRefersToItself(t *testing.T) {
	t.Parallel()
	f := newSnapshotFixture(t)
	m := f.m
	m.Revision = "v2"
	m.Ref = ""
	cdir, err := f.s.Materialize(m)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(f.s.repoDir(m.Name), "snapshots", "v2"), cdir)
	b, err := os.ReadFile(filepath.Join(f.s.repoDir(m.Name), "refs", "v2"))
	require.NoError(t, err)
	require.Equal(t, "v2", string(b), "huggingface_hub's offline download looks a revision that is not a commit up in refs/ only")
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
			rec, err := json.Marshal(snapshotRecord{
				modelRecord: modelRecord{Dir: mustRel(f.s.Root(), dir), Digest: []digest.Digest{
					f.m.Files[0].Digest, f.m.Files[1].Digest, f.m.Files[2].Digest,
				}},
				Paths: []string{f.m.Files[0].Path, f.m.Files[1].Path, f.m.Files[2].Path},
			})
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

// A name and revision name one set of files for good: materialising other
// files under them is refused, and the snapshot, its refs and its index
// record stay as they were (a source whose content moves on names it with a
// new revision). Attack 1 of issue 21, at the store.
func TestMaterializeNeverReplacesSnapshotWithOtherFiles(t *testing.T) {
	t.Parallel()
	f := newSnapshotFixture(t)
	dir, err := f.s.Materialize(f.m)
	require.NoError(t, err)
	key := f.m.Name + "@" + f.m.Revision
	record := func() []byte {
		var rec []byte
		require.NoError(t, f.s.db.View(func(tx *bolt.Tx) error {
			rec = bytes.Clone(tx.Bucket(bucketModels).Get([]byte(key)))
			return nil
		}))
		return rec
	}
	before, rec := idOf(t, dir), record()
	for name, files := range map[string][]content.File{
		"fewer files":       f.m.Files[:2],
		"one more file":     append(slices.Clone(f.m.Files), content.File{Path: "modeling_evil.py", Descriptor: f.spare}),
		"renamed file":      {f.m.Files[0], {Path: "weights.safetensors", Descriptor: f.m.Files[1].Descriptor}, f.m.Files[2]},
		"other content":     {{Path: "config.json", Descriptor: f.spare}, f.m.Files[1], f.m.Files[2]},
		"paths swapped":     {{Path: f.m.Files[0].Path, Descriptor: f.m.Files[2].Descriptor}, f.m.Files[1], {Path: f.m.Files[2].Path, Descriptor: f.m.Files[0].Descriptor}},
		"other, with a ref": {{Path: "config.json", Descriptor: f.spare}, f.m.Files[1], f.m.Files[2]},
	} {
		m := f.m
		m.Files = files
		if name == "other, with a ref" {
			m.Ref = "v2"
		}
		_, err := f.s.Materialize(m)
		require.ErrorIs(t, err, ErrSnapshotConflict, name)
		require.Equal(t, before, idOf(t, dir), "%s: snapshot replaced", name)
		f.requireSnapshot(t, dir)
		require.Equal(t, rec, record(), "%s: index record changed", name)
		_, err = os.Lstat(filepath.Join(f.s.repoDir(f.m.Name), "refs", "v2"))
		require.ErrorIs(t, err, os.ErrNotExist, "%s: a refused model moves no ref", name)
	}

	// After a restart, and with the index record lost, the snapshot on disk
	// is what counts: still refused.
	require.NoError(t, f.s.Close())
	s2 := openStore(t, f.s.Root())
	require.NoError(t, s2.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketModels).Delete([]byte(key)) }))
	m := f.m
	m.Files = []content.File{{Path: "config.json", Descriptor: f.spare}, f.m.Files[1], f.m.Files[2]}
	_, err = s2.Materialize(m)
	require.ErrorIs(t, err, ErrSnapshotConflict)
	require.Equal(t, before, idOf(t, dir))

	// The same files are laid out again under a new record, as before.
	dir2, err := s2.Materialize(f.m)
	require.NoError(t, err)
	require.Equal(t, dir, dir2)
	f.s = s2
	f.requireSnapshot(t, dir)

	// A record written before paths were kept (the blobs in order) still
	// lets a damaged snapshot of the same files be mended, and nothing else
	// replace it.
	legacy, err := json.Marshal(modelRecord{Dir: mustRel(s2.Root(), dir), Digest: []digest.Digest{
		f.m.Files[0].Digest, f.m.Files[1].Digest, f.m.Files[2].Digest,
	}})
	require.NoError(t, err)
	require.NoError(t, s2.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketModels).Put([]byte(key), legacy) }))
	require.NoError(t, os.Remove(filepath.Join(dir, "config.json")))
	_, err = s2.Materialize(m)
	require.ErrorIs(t, err, ErrSnapshotConflict)
	_, err = s2.Materialize(f.m)
	require.NoError(t, err)
	f.requireSnapshot(t, dir)
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
	// Checked on the test's goroutine: require.Never can leave a check
	// running after it returns, which would then read the closed index.
	for range 20 {
		require.Equal(t, committed, indexed(s), "an access within the granularity is not written")
		time.Sleep(5 * time.Millisecond)
	}

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
	require.ErrorIs(t, err, content.ErrNotFound)
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

// A snapshot removed because a blob of it was evicted takes the refs that
// hold its revision with it, and only those: huggingface_hub's
// scan_cache_dir and huggingface.js's scanCachedRepo call a repository with
// a ref to a missing snapshot corrupt. Opening the store removes the temp
// files of refs whose writer died.
func TestPruneRemovesRefsToRemovedSnapshots(t *testing.T) {
	t.Parallel()
	f := newSnapshotFixture(t)
	refs := filepath.Join(f.s.repoDir(f.m.Name), "refs")
	first := f.m
	_, err := f.s.Materialize(first)
	require.NoError(t, err)
	for _, ref := range []string{"v1.0", "refs/pr/1"} {
		tag := first
		tag.Ref = ref
		_, err = f.s.Materialize(tag)
		require.NoError(t, err)
	}
	// main moves on to a commit of the spare blob alone.
	second := content.Model{Name: first.Name, Revision: "fedcba9876543210fedcba9876543210fedcba98", Ref: "main",
		Files: []content.File{{Path: "config.json", Descriptor: f.spare}}}
	dir2, err := f.s.Materialize(second)
	require.NoError(t, err)

	require.NoError(t, f.s.evict(first.Files[1].Digest, false))
	_, err = os.Stat(filepath.Join(filepath.Dir(dir2), first.Revision))
	require.ErrorIs(t, err, os.ErrNotExist, "the first snapshot is gone")
	var left []string
	require.NoError(t, filepath.WalkDir(refs, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			rel, _ := filepath.Rel(refs, p)
			left = append(left, filepath.ToSlash(rel))
		}
		return err
	}))
	require.Equal(t, []string{"main"}, left, "the refs to the first snapshot went with it")
	b, err := os.ReadFile(filepath.Join(refs, "main"))
	require.NoError(t, err)
	require.Equal(t, second.Revision, string(b))

	// A writer of refs/main died between writing its temp file and renaming it.
	require.NoError(t, os.WriteFile(filepath.Join(refs, ".tmp-main-123"), []byte("fedcba"), refPerm))
	require.NoError(t, os.MkdirAll(filepath.Join(refs, "refs", "pr"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(refs, "refs", "pr", ".tmp-2-456"), nil, refPerm))
	require.NoError(t, f.s.Close())
	s2 := openStore(t, f.s.Root())
	tmps, _ := filepath.Glob(filepath.Join(refs, ".tmp-*"))
	tmps2, _ := filepath.Glob(filepath.Join(refs, "refs", "pr", ".tmp-*"))
	require.Empty(t, append(tmps, tmps2...))
	_, err = s2.Materialize(second)
	require.NoError(t, err)
}

func TestLinkedBlob(t *testing.T) {
	t.Parallel()
	hex := strings.Repeat("ab", 32)
	for target, want := range map[string]bool{
		"../../../../blobs/sha256/" + hex:            true,
		"/var/lib/weightd/blobs/sha256/" + hex:       true,
		"../../blobs/sha256/" + hex[:62]:             false,
		"../../blobs/sha512/" + hex:                  false,
		"../../other/sha256/" + hex:                  false,
		"config.json":                                false,
		"../../blobs/sha256/" + strings.ToUpper(hex): false,
	} {
		d, ok := LinkedBlob(target)
		if ok != want || (ok && d.Encoded() != hex) {
			t.Errorf("LinkedBlob(%q) = %s, %v; want %v", target, d, ok, want)
		}
	}
}
