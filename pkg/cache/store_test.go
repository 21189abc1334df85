package cache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

func TestFetchStoresVerifiedBlob(t *testing.T) {
	t.Parallel()
	for _, size := range []int{0, 1, 64 << 10, 64<<10 + 1, 1<<20 + 12345} {
		data := randomBytes(uint64(size), size)
		s := openStore(t, t.TempDir())
		src := &memSource{data: data}
		var last int64
		info, err := s.Fetch(context.Background(), descOf(data), src, func(done, _, total int64) { last = done })
		require.NoError(t, err, "size %d", size)
		require.Equal(t, descOf(data), info.Descriptor)
		require.Equal(t, int64(size), last)

		f, err := s.Open(info.Digest)
		require.NoError(t, err)
		got, err := io.ReadAll(f)
		f.Close()
		require.NoError(t, err)
		require.True(t, bytes.Equal(data, got))

		p, _ := s.BlobPath(info.Digest)
		st, err := os.Stat(p)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o444), st.Mode().Perm(), "blobs are read-only")
		entries, _ := os.ReadDir(partialDir(s.Root()))
		require.Empty(t, entries, "no partial left after commit")

		cs, err := s.ChunkState(info.Digest)
		require.NoError(t, err)
		require.True(t, cs.Complete)
		n := (size + 64<<10 - 1) / (64 << 10)
		require.Len(t, cs.Hashes, n*32)
		for i := range n {
			end := min((i+1)*64<<10, size)
			sum := sha256.Sum256(data[i*64<<10 : end])
			require.Equal(t, sum[:], cs.Hash(i), "chunk %d", i)
		}
		require.False(t, cs.Has(n))
		// A second fetch is a hit and does not touch the source.
		_, err = s.Fetch(context.Background(), descOf(data), src, nil)
		require.NoError(t, err)
		require.Len(t, src.opens(), min(1, size))
	}
}

func TestFetchRejectsBadInput(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(1, 1000)
	for name, desc := range map[string]content.Descriptor{
		"empty digest":   {Size: 1},
		"sha512":         {Digest: digest.SHA512.FromBytes(data), Size: 1000},
		"short hex":      {Digest: "sha256:abcd", Size: 1000},
		"upper hex":      {Digest: digest.Digest("sha256:" + string(bytes.ToUpper([]byte(digest.FromBytes(data).Encoded())))), Size: 1000},
		"path traversal": {Digest: "sha256:../../etc/passwd", Size: 1000},
		"negative size":  {Digest: digest.FromBytes(data), Size: -1},
	} {
		_, err := s.Fetch(context.Background(), desc, &memSource{data: data}, nil)
		require.ErrorIs(t, err, content.ErrInvalid, name)
	}
	_, err := s.Stat("sha256:zz")
	require.ErrorIs(t, err, content.ErrInvalid)
	_, err = s.Open(digest.FromBytes(data))
	require.ErrorIs(t, err, content.ErrNotFound)
}

func TestFetchDigestMismatchCommitsNothing(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	s := openStore(t, t.TempDir(), WithRegisterer(reg))
	data := randomBytes(2, 300<<10)
	lie := bytes.Clone(data)
	lie[200<<10] ^= 1
	_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: lie}, nil)
	require.ErrorIs(t, err, content.ErrDigestMismatch)
	_, err = s.Stat(descOf(data).Digest)
	require.ErrorIs(t, err, content.ErrNotFound)
	entries, _ := os.ReadDir(blobsDir(s.Root()))
	require.Empty(t, entries)
	entries, _ = os.ReadDir(partialDir(s.Root()))
	require.Empty(t, entries, "a blob that failed verification leaves no partial")
	require.Equal(t, 1.0, testutil.ToFloat64(s.m.verificationFailures))

	// The right bytes from elsewhere then succeed.
	_, err = s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)
}

func TestFetchSizeMismatch(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(3, 100<<10)
	longer := append(bytes.Clone(data), 'x')
	_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: longer}, nil)
	require.ErrorIs(t, err, content.ErrSizeMismatch)

	// A source that always ends early is retried, then fails clearly.
	short := &memSource{data: data[:50<<10]}
	_, err = s.Fetch(context.Background(), descOf(data), short, nil)
	require.ErrorContains(t, err, "ended the stream")
	require.Len(t, short.opens(), 4, "retried up to the attempt limit")
	requireOnlyVerifiedBlobs(t, s.Root())
}

func TestFetchResumesByRangeAfterDrops(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(4, 1<<20)
	src := &memSource{data: data, dropAfter: []int64{100_000, 300_000, 5}}
	info, err := s.Fetch(context.Background(), descOf(data), src, nil)
	require.NoError(t, err)
	require.Equal(t, descOf(data), info.Descriptor)
	require.Equal(t, []int64{0, 100_000, 400_000, 400_005}, src.opens(), "each retry resumes at the next byte needed")
}

func TestFetchRetriesStalledSource(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir(), WithStallTimeout(100*time.Millisecond))
	data := randomBytes(5, 500<<10)
	src := &memSource{data: data, dropAfter: []int64{200_000}, stallFor: []time.Duration{time.Hour}}
	_, err := s.Fetch(context.Background(), descOf(data), src, nil)
	require.NoError(t, err)
	require.Equal(t, []int64{0, 200_000}, src.opens())
}

func TestFetchPermanentErrorIsNotRetried(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(6, 1000)
	src := &memSource{data: data, openErr: content.Permanent(io.ErrUnexpectedEOF)}
	_, err := s.Fetch(context.Background(), descOf(data), src, nil)
	require.ErrorIs(t, err, content.ErrPermanent)
	require.Len(t, src.opens(), 1)
}

func TestConcurrentFetchesShareOneDownload(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(7, 2<<20)
	src := &memSource{data: data, delay: time.Millisecond}
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = s.Fetch(context.Background(), descOf(data), src, nil)
		}()
	}
	// While it runs, the download reports how long it has held the blob.
	require.Eventually(t, func() bool {
		u := s.Usage()
		return len(u.InFlight) == 1 && u.InFlight[0].HeldFor > 0 || len(src.opens()) > 0 && len(s.List()) == 1
	}, 5*time.Second, time.Millisecond)
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, []int64{0}, src.opens(), "one download however many callers")
}

func TestAbandonedFetchKeepsProgressAndResumes(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	s := openStore(t, root, WithCheckpointInterval(0))
	data := randomBytes(8, 4<<20)
	src := &memSource{data: data, delay: time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() {
		_, err := s.Fetch(ctx, descOf(data), src, nil)
		done <- err
	}()
	require.Eventually(t, func() bool {
		u := s.Usage()
		return len(u.InFlight) == 1 && u.InFlight[0].Done >= 1<<20
	}, 10*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	require.NoError(t, s.Close())

	// A new process (a reopened store) resumes from the saved progress.
	s2 := openStore(t, root)
	src2 := &memSource{data: data}
	_, err := s2.Fetch(context.Background(), descOf(data), src2, nil)
	require.NoError(t, err)
	require.Len(t, src2.opens(), 1)
	require.GreaterOrEqual(t, src2.opens()[0], int64(512<<10), "resumed, not restarted")
	requireOnlyVerifiedBlobs(t, root)
}

func TestCorruptPartialStartsOver(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	s := openStore(t, root, WithCheckpointInterval(0))
	data := randomBytes(9, 1<<20)
	src := &memSource{data: data, dropAfter: []int64{600 << 10}, openErr: nil}
	s.opts.attempts = 1
	_, err := s.Fetch(context.Background(), descOf(data), src, nil)
	require.Error(t, err)
	require.NoError(t, s.Close())

	// Flip a byte inside the saved prefix: the resume check must notice.
	f, err := os.OpenFile(filepath.Join(partialDir(root), descOf(data).Digest.Encoded()+".data"), os.O_RDWR, 0)
	require.NoError(t, err)
	_, err = f.WriteAt([]byte{0xff ^ data[1000]}, 1000)
	require.NoError(t, err)
	f.Close()

	s2 := openStore(t, root)
	src2 := &memSource{data: data}
	_, err = s2.Fetch(context.Background(), descOf(data), src2, nil)
	require.NoError(t, err)
	require.Equal(t, []int64{0}, src2.opens())
	requireOnlyVerifiedBlobs(t, root)
}

func TestRestartReconcilesIndexWithDisk(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	s := openStore(t, root)
	a, b := randomBytes(10, 1000), randomBytes(11, 2000)
	for _, data := range [][]byte{a, b} {
		_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
		require.NoError(t, err)
	}
	require.NoError(t, s.Pin(descOf(a).Digest, "pod:x"))
	require.NoError(t, s.Close())
	// b's file vanishes behind the store's back; a stray file appears.
	require.NoError(t, os.Remove(filepath.Join(blobsDir(root), descOf(b).Digest.Encoded())))
	require.NoError(t, os.WriteFile(filepath.Join(blobsDir(root), "junk"), []byte("x"), 0o644))

	s2 := openStore(t, root)
	info, err := s2.Stat(descOf(a).Digest)
	require.NoError(t, err)
	require.Equal(t, []string{"pod:x"}, info.Pins, "pins survive restarts")
	_, err = s2.Stat(descOf(b).Digest)
	require.ErrorIs(t, err, content.ErrNotFound)
	_, err = os.Stat(filepath.Join(blobsDir(root), "junk"))
	require.ErrorIs(t, err, os.ErrNotExist)
	// The chunk map is still there after a restart.
	cs, err := s2.ChunkState(descOf(a).Digest)
	require.NoError(t, err)
	require.True(t, cs.Has(0))
	require.Len(t, cs.Hashes, 32)
}

func TestSecondProcessCannotOpenRoot(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	openStore(t, root)
	_, err := Open(root)
	require.ErrorContains(t, err, "in use by another process")
}

func TestEvictionIsLRUAndSparesPins(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	s := openStore(t, t.TempDir(), WithBudget(3*100<<10, 0), WithRegisterer(reg))
	blobs := make([][]byte, 4)
	for i := range blobs {
		blobs[i] = randomBytes(uint64(20+i), 100<<10)
	}
	fetch := func(b []byte) error {
		_, err := s.Fetch(context.Background(), descOf(b), &memSource{data: b}, nil)
		return err
	}
	for _, b := range blobs[:3] {
		require.NoError(t, fetch(b))
		time.Sleep(2 * time.Millisecond)
	}
	require.NoError(t, s.Pin(descOf(blobs[0]).Digest, "policy:base"))
	// blobs[1] is now the least recently used unpinned blob.
	require.NoError(t, fetch(blobs[3]))
	_, err := s.Stat(descOf(blobs[1]).Digest)
	require.ErrorIs(t, err, content.ErrNotFound, "LRU blob evicted")
	for _, i := range []int{0, 2, 3} {
		_, err := s.Stat(descOf(blobs[i]).Digest)
		require.NoError(t, err, "blob %d kept", i)
	}
	require.Equal(t, 1.0, testutil.ToFloat64(s.m.evictions))

	// With everything pinned, a new blob cannot fit: a clear error, nothing lost.
	for _, i := range []int{2, 3} {
		require.NoError(t, s.Pin(descOf(blobs[i]).Digest, "pod:y"))
	}
	err = fetch(blobs[1])
	require.ErrorIs(t, err, ErrDiskFull)
	require.ErrorContains(t, err, "budget")
	require.Len(t, s.List(), 3)
	require.Equal(t, 1.0, testutil.ToFloat64(s.m.diskFull))
	require.Zero(t, s.Usage().PartialBytes)

	require.NoError(t, s.Unpin(descOf(blobs[2]).Digest, "pod:y"))
	require.NoError(t, fetch(blobs[1]))
}

func TestMaterializeLinksWithoutCopy(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	files := map[string][]byte{
		"config.json":                      []byte(`{"model_type":"llama"}`),
		"model-00001-of-00002.safetensors": randomBytes(30, 200<<10),
		"model-00002-of-00002.safetensors": randomBytes(31, 100<<10),
		"tokenizer/tokenizer.json":         []byte(`{}`),
	}
	m := content.Model{Name: "org/tiny", Revision: "main"}
	for p, b := range files {
		_, err := s.Fetch(context.Background(), descOf(b), &memSource{data: b}, nil)
		require.NoError(t, err)
		m.Files = append(m.Files, content.File{Path: p, Descriptor: descOf(b)})
	}
	dir, err := s.Materialize(m)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(s.Root(), "models", "models--org--tiny", "snapshots", "main"), dir)
	for p, b := range files {
		full := filepath.Join(dir, p)
		lst, err := os.Lstat(full)
		require.NoError(t, err)
		require.Equal(t, os.ModeSymlink, lst.Mode().Type(), "%s is a link, not a copy", p)
		target, _ := os.Readlink(full)
		require.False(t, filepath.IsAbs(target), "links are relative so the cache can be mounted anywhere")
		got, err := os.ReadFile(full)
		require.NoError(t, err)
		require.True(t, bytes.Equal(b, got))
	}
	ref, err := os.ReadFile(filepath.Join(s.Root(), "models", "models--org--tiny", "refs", "main"))
	require.NoError(t, err)
	require.Equal(t, "main", string(ref))

	// Materialising fewer files at the same revision is refused: the
	// snapshot stays whole.
	fewer := m
	fewer.Files = m.Files[:1]
	_, err = s.Materialize(fewer)
	require.ErrorIs(t, err, ErrSnapshotConflict)
	entries, _ := os.ReadDir(dir)
	require.Len(t, entries, 4, "three links and the tokenizer directory")
	leftovers, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), ".tmp-*"))
	require.Empty(t, leftovers)

	// Evicting a blob removes the snapshot that links to it: no dangling links.
	require.NoError(t, s.evict(m.Files[0].Digest, false))
	_, err = os.Stat(dir)
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestMaterializeRejectsMissingBlobsAndBadPaths(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(40, 10)
	_, err := s.Materialize(content.Model{Name: "org/m", Revision: "main", Files: []content.File{{Path: "a", Descriptor: descOf(data)}}})
	require.ErrorIs(t, err, content.ErrNotFound)
	_, err = s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)
	for _, p := range []string{"../escape", "/abs", "a/../../b", "a\x00b", "", "a//b", "./a", `a\b`} {
		_, err := s.Materialize(content.Model{Name: "org/m", Revision: "main", Files: []content.File{{Path: p, Descriptor: descOf(data)}}})
		require.ErrorIs(t, err, content.ErrInvalid, "path %q", p)
	}
	for _, name := range []string{"", "a/b/c/d", "../x", "org/.hidden", "org--x/y", "org/x y"} {
		_, err := s.Materialize(content.Model{Name: name, Revision: "main"})
		require.ErrorIs(t, err, content.ErrInvalid, "name %q", name)
	}
	_, err = s.Materialize(content.Model{Name: "org/m", Revision: "../main"})
	require.ErrorIs(t, err, content.ErrInvalid)
	_, err = s.Materialize(content.Model{Name: "org/m", Revision: "main", Files: []content.File{
		{Path: "a", Descriptor: descOf(data)}, {Path: "a/b", Descriptor: descOf(data)},
	}})
	require.ErrorIs(t, err, content.ErrInvalid)
}

func TestHoldProtectsFromEviction(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir(), WithBudget(2*100<<10, 0))
	a, b, c := randomBytes(70, 100<<10), randomBytes(71, 100<<10), randomBytes(72, 100<<10)
	release := s.Hold(descOf(a).Digest) // held before it is even present
	for _, data := range [][]byte{a, b, c} {
		_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
		require.NoError(t, err)
	}
	_, err := s.Stat(descOf(a).Digest)
	require.NoError(t, err, "held blob kept although least recently used")
	_, err = s.Stat(descOf(b).Digest)
	require.ErrorIs(t, err, content.ErrNotFound)
	release()
	release() // idempotent
	_, err = s.Fetch(context.Background(), descOf(b), &memSource{data: b}, nil)
	require.NoError(t, err)
	_, err = s.Stat(descOf(a).Digest)
	require.ErrorIs(t, err, content.ErrNotFound, "released blob is evictable again")
}

// A blob changed on disk by hand is discarded whatever holds it, and the
// next Fetch downloads it again.
func TestDiscardChangedBlob(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	data := randomBytes(73, 100<<10)
	d := descOf(data).Digest
	release := s.Hold(d)
	defer release()
	_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)
	p, err := s.BlobPath(d)
	require.NoError(t, err)
	require.NoError(t, os.Chmod(p, 0o644))
	require.NoError(t, os.Truncate(p, 1))

	require.NoError(t, s.Discard(d))
	_, err = s.Stat(d)
	require.ErrorIs(t, err, content.ErrNotFound)
	_, err = os.Stat(p)
	require.ErrorIs(t, err, os.ErrNotExist)
	require.NoError(t, s.Discard(d), "discarding what is gone is no error")

	_, err = s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)
	got, err := os.ReadFile(p)
	require.NoError(t, err)
	require.Equal(t, data, got)
}
