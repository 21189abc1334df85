package adversary

// Helpers of the disk attacks (cache_wipe_test.go, disk_fill_test.go,
// disk_pressure_test.go). Their names start with "disk" so that the other
// attacks' files in this package can have their own.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/source/oci"
)

// diskOrigin serves files from memory over HTTP with ranges and HEAD
// (http.ServeContent); a path in heads answers HEAD with that
// Content-Length instead, whatever its body: an origin that lies.
type diskOrigin struct {
	srv   *httptest.Server
	mu    sync.Mutex
	files map[string][]byte
	heads map[string]int64
}

func newDiskOrigin(t *testing.T) *diskOrigin {
	t.Helper()
	o := &diskOrigin{files: make(map[string][]byte), heads: make(map[string]int64)}
	o.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		o.mu.Lock()
		data, ok := o.files[r.URL.Path]
		head, lie := o.heads[r.URL.Path]
		o.mu.Unlock()
		if r.Method == http.MethodHead && lie {
			w.Header().Set("Content-Length", strconv.FormatInt(head, 10))
			return
		}
		if !ok {
			http.NotFound(w, r)
			return
		}
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	}))
	t.Cleanup(o.srv.Close)
	return o
}

// put serves data at path.
func (o *diskOrigin) put(path string, data []byte) {
	o.mu.Lock()
	o.files[path] = data
	o.mu.Unlock()
}

// lie answers HEAD of path with a Content-Length of size.
func (o *diskOrigin) lie(path string, size int64) {
	o.mu.Lock()
	o.heads[path] = size
	o.mu.Unlock()
}

// url is the URL of path.
func (o *diskOrigin) url(path string) string { return o.srv.URL + path }

// diskFile is one file of a model manifest; size is what the manifest
// claims, data what the origin serves.
type diskFile struct {
	path string
	data []byte
	size int64 // 0: len(data)
}

// model serves the files and a manifest of them at /<name>/model.json, and
// returns the manifest's URL.
func (o *diskOrigin) model(t *testing.T, name string, files ...diskFile) string {
	t.Helper()
	type file struct {
		Path   string `json:"path"`
		Size   int64  `json:"size"`
		SHA256 string `json:"sha256"`
	}
	doc := struct {
		Name     string `json:"name"`
		Revision string `json:"revision"`
		Files    []file `json:"files"`
	}{Name: name, Revision: "main"}
	for _, f := range files {
		size := f.size
		if size == 0 {
			size = int64(len(f.data))
		}
		sum := sha256.Sum256(f.data)
		doc.Files = append(doc.Files, file{Path: f.path, Size: size, SHA256: hex.EncodeToString(sum[:])})
		o.put("/"+name+"/"+f.path, f.data)
	}
	body, err := json.Marshal(doc)
	require.NoError(t, err)
	o.put("/"+name+"/model.json", body)
	return o.url("/" + name + "/model.json")
}

// diskBytes is n pseudo-random bytes, different for each seed.
func diskBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	x := seed*0x9e3779b97f4a7c15 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
	return b
}

// diskStore opens a store at root, its metrics on a registry of its own.
func diskStore(t *testing.T, root string, opts ...cache.Option) (*cache.Store, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	s, err := cache.Open(root, append([]cache.Option{cache.WithRegisterer(reg), cache.WithChunkSize(256 << 10)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s, reg
}

// diskQueue runs a prefetch queue over store with the agent's HTTP and OCI
// sources until the test ends.
func diskQueue(t *testing.T, store *cache.Store) *prefetch.Queue {
	t.Helper()
	src := diskSources{http: httpsource.New(nil), oci: oci.New()}
	q := prefetch.NewQueue(store, src, prefetch.WithLogger(slog.New(slog.DiscardHandler)))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- q.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		assert.NoError(t, <-done)
	})
	return q
}

// diskSources sends each reference to the source of its kind.
type diskSources struct {
	http *httpsource.Source
	oci  *oci.Source
}

func (s diskSources) Resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	if r.Kind == ref.KindOCI {
		return s.oci.Resolve(ctx, r)
	}
	return s.http.Resolve(ctx, r)
}

// diskFetch submits ref and waits for its job to finish.
func diskFetch(t *testing.T, q *prefetch.Queue, ref string) (prefetch.JobStatus, error) {
	t.Helper()
	j, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	st, err := j.Wait(ctx)
	require.NoError(t, ctx.Err(), "job %s did not finish", ref)
	return st, err
}

// diskMetric is the value of the store's metric name (a gauge or counter
// without labels).
func diskMetric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		m := f.GetMetric()[0]
		if m.GetGauge() != nil {
			return m.GetGauge().GetValue()
		}
		return m.GetCounter().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// diskRequireIntact checks that every blob in want is still in the store,
// and that every file under blobs/ is what its name says.
func diskRequireIntact(t *testing.T, s *cache.Store, want []cache.Info) {
	t.Helper()
	for _, info := range want {
		_, err := s.Stat(info.Digest)
		require.NoError(t, err, "blob %s (%d bytes) was evicted", info.Digest, info.Size)
	}
	dir := filepath.Join(s.Root(), "blobs", "sha256")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		f, err := os.Open(filepath.Join(dir, e.Name()))
		require.NoError(t, err)
		d, err := digest.SHA256.FromReader(f)
		f.Close()
		require.NoError(t, err)
		require.Equal(t, e.Name(), d.Encoded(), "blob file does not match its name")
	}
}

// diskSpace is the size of the filesystem holding dir and its free bytes.
func diskSpace(t *testing.T, dir string) (total, free int64) {
	t.Helper()
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &st))
	return int64(st.Blocks) * st.Bsize, int64(st.Bavail) * st.Bsize
}

// diskWatch samples, until the test ends or stop is called, the largest
// total size of the files directly under dir whose names match glob.
func diskWatch(t *testing.T, dir, glob string) (stop func() int64) {
	t.Helper()
	var (
		mu   sync.Mutex
		peak int64
	)
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		for {
			var sum int64
			matches, _ := filepath.Glob(filepath.Join(dir, glob))
			for _, m := range matches {
				if info, err := os.Stat(m); err == nil {
					sum += info.Size()
				}
			}
			mu.Lock()
			peak = max(peak, sum)
			mu.Unlock()
			select {
			case <-done:
				return
			case <-time.After(500 * time.Microsecond):
			}
		}
	}()
	var once sync.Once
	stop = func() int64 {
		once.Do(func() { close(done); <-finished })
		mu.Lock()
		defer mu.Unlock()
		return peak
	}
	t.Cleanup(func() { stop() })
	return stop
}

// diskSeed fetches a small model of n files of size bytes each through q
// and returns its blobs: what an attack must not evict.
func diskSeed(t *testing.T, q *prefetch.Queue, o *diskOrigin, s *cache.Store, name string, n, size int) []cache.Info {
	t.Helper()
	var files []diskFile
	for i := range n {
		files = append(files, diskFile{path: fmt.Sprintf("f%d.bin", i), data: diskBytes(uint64(len(name)*1000+i), size)})
	}
	st, err := diskFetch(t, q, o.model(t, name, files...))
	require.NoError(t, err)
	require.Equal(t, prefetch.StateReady, st.State)
	var out []cache.Info
	for _, f := range files {
		info, err := s.Stat(digest.FromBytes(f.data))
		require.NoError(t, err)
		out = append(out, info)
	}
	return out
}
