package cache

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/content"
)

func TestDiskFull(t *testing.T) {
	disk := testdisk.Tmpfs(t, 8<<20)
	reg := prometheus.NewRegistry()
	s := openStore(t, filepath.Join(disk, "cache"), WithRegisterer(reg))

	// Another tenant fills most of the disk.
	filler := filepath.Join(disk, "filler")
	require.NoError(t, os.WriteFile(filler, randomBytes(50, 6<<20), 0o644))

	data := randomBytes(51, 4<<20)
	_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.ErrorIs(t, err, ErrDiskFull)
	require.ErrorContains(t, err, "free on disk")
	require.Equal(t, 1.0, testutil.ToFloat64(s.m.diskFull))
	requireOnlyVerifiedBlobs(t, s.Root())
	entries, _ := os.ReadDir(partialDir(s.Root()))
	require.Empty(t, entries, "a refused download leaves nothing behind")

	// The kernel's own ENOSPC maps to the same error.
	f, err := os.Create(filepath.Join(disk, "big"))
	require.NoError(t, err)
	require.ErrorIs(t, allocate(f, 64<<20), ErrDiskFull)
	f.Close()
	os.Remove(filepath.Join(disk, "big"))

	// The store stays usable: once space is back, the same fetch succeeds.
	require.NoError(t, os.Remove(filler))
	_, err = s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)

	// Our own old blobs are evicted to make room on a full disk.
	require.NoError(t, os.WriteFile(filler, randomBytes(52, 3<<20), 0o644))
	other := randomBytes(53, 3<<20)
	_, err = s.Fetch(context.Background(), descOf(other), &memSource{data: other}, nil)
	require.NoError(t, err)
	_, err = s.Stat(descOf(data).Digest)
	require.ErrorIs(t, err, content.ErrNotFound)
	requireOnlyVerifiedBlobs(t, s.Root())
}

// httpOpener reads a blob with HTTP range requests (the cache's own tests
// cannot use pkg/prefetch: the cache imports no other weightd package).
type httpOpener struct{ url string }

func (h httpOpener) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-", off))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusPartialContent {
		resp.Body.Close()
		return nil, fmt.Errorf("status %s", resp.Status)
	}
	return resp.Body, nil
}

// TestHelperIngestProcess is the child of TestKilledDuringIngest: it fetches
// one blob into a store and exits. It does nothing in a normal test run.
func TestHelperIngestProcess(t *testing.T) {
	root := os.Getenv("WEIGHTD_HELPER_ROOT")
	if root == "" {
		return
	}
	size, _ := strconv.ParseInt(os.Getenv("WEIGHTD_HELPER_SIZE"), 10, 64)
	s, err := Open(root, WithChunkSize(256<<10), WithCheckpointInterval(10*time.Millisecond), WithBudget(0, 0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	desc := content.Descriptor{Digest: digest.Digest(os.Getenv("WEIGHTD_HELPER_DIGEST")), Size: size}
	if _, err := s.Fetch(context.Background(), desc, httpOpener{os.Getenv("WEIGHTD_HELPER_URL")}, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	s.Close()
	os.Exit(0)
}

// TestKilledDuringIngest kills a process ingesting a blob with SIGKILL at
// random points, 20 times. After every kill nothing unverified is visible and
// the store opens cleanly; the last run ends with the verified blob.
func TestKilledDuringIngest(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns 20 processes")
	}
	data := randomBytes(60, 32<<20)
	desc := descOf(data)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Throttled to about 40 MB/s so that kills land mid-download.
		http.ServeContent(w, r, "blob", time.Time{}, &slowReader{r: bytes.NewReader(data)})
	}))
	defer srv.Close()

	root := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	var progress []int64
	statePath := filepath.Join(partialDir(root), desc.Digest.Encoded()+".state")
	saved := func() int64 {
		var st partialState
		if b, err := os.ReadFile(statePath); err == nil && json.Unmarshal(b, &st) == nil {
			return st.Hashed
		}
		return 0
	}
	// run starts the child and kills it when killAt says so (nil: let it finish).
	run := func(killAt func() bool) error {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHelperIngestProcess$")
		cmd.Env = append(os.Environ(),
			"WEIGHTD_HELPER_ROOT="+root, "WEIGHTD_HELPER_URL="+srv.URL,
			"WEIGHTD_HELPER_DIGEST="+string(desc.Digest), "WEIGHTD_HELPER_SIZE="+strconv.Itoa(len(data)))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		require.NoError(t, cmd.Start())
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		if killAt == nil {
			if err := <-exited; err != nil {
				return fmt.Errorf("%w: %s", err, stderr.String())
			}
			return nil
		}
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !killAt(); {
			select {
			case <-exited:
				return nil // finished before the kill point
			case <-time.After(2 * time.Millisecond):
			}
		}
		cmd.Process.Signal(syscall.SIGKILL)
		<-exited
		return nil
	}
	for round := range 20 {
		var killAt func() bool
		if round%4 == 0 {
			// Early: during start-up, reservation or the first request.
			at := time.Now().Add(time.Duration(rng.IntN(60)) * time.Millisecond)
			killAt = func() bool { return time.Now().After(at) }
		} else {
			// Mid-download: once the saved progress passes a random point
			// ahead (plus a random delay, so kills also land between checkpoints).
			target := saved() + rng.Int64N(int64(len(data))/8) + 1
			delay := time.Duration(rng.IntN(20)) * time.Millisecond
			var reached time.Time
			killAt = func() bool {
				if reached.IsZero() && saved() >= target {
					reached = time.Now()
				}
				return !reached.IsZero() && time.Since(reached) >= delay
			}
		}
		require.NoError(t, run(killAt))
		requireOnlyVerifiedBlobs(t, root)
		s, err := Open(root, WithChunkSize(256<<10))
		require.NoError(t, err, "round %d: the store opens after a kill", round)
		if f, err := s.Open(desc.Digest); err == nil {
			got, _ := io.ReadAll(f)
			f.Close()
			require.True(t, bytes.Equal(data, got), "round %d: a readable blob is the right blob", round)
		} else {
			require.ErrorIs(t, err, content.ErrNotFound)
		}
		if st := s.readState(desc); st != nil {
			progress = append(progress, st.Hashed)
		}
		require.NoError(t, s.Close())
	}
	require.NoError(t, run(nil))
	requireOnlyVerifiedBlobs(t, root)
	s := openStore(t, root, WithChunkSize(256<<10))
	info, err := s.Stat(desc.Digest)
	require.NoError(t, err)
	require.Equal(t, desc, info.Descriptor)
	require.NotEmpty(t, progress, "some kills landed mid-download with progress saved")
	t.Logf("saved progress seen after kills: %v", progress)
}

type slowReader struct{ r *bytes.Reader }

func (s *slowReader) Read(p []byte) (int, error) {
	if len(p) > 32<<10 {
		p = p[:32<<10]
	}
	time.Sleep(800 * time.Microsecond)
	return s.r.Read(p)
}

func (s *slowReader) Seek(off int64, whence int) (int64, error) { return s.r.Seek(off, whence) }
