package genmodel_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/genmodel"
)

// serve generates a one-file model of size bytes and serves it; it returns
// the server and the file's bytes.
func serve(t *testing.T, size int64, opts ...genmodel.ServerOption) (*genmodel.Server, []byte) {
	t.Helper()
	dir := t.TempDir()
	_, err := genmodel.Generate(dir, genmodel.Spec{Name: "org/m", Files: 1, TotalBytes: size, Seed: 7})
	require.NoError(t, err)
	data, err := os.ReadFile(filepath.Join(dir, "model.safetensors"))
	require.NoError(t, err)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := genmodel.NewServer(ln, dir, opts...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after cancel")
		}
	})
	return s, data
}

// get GETs path with an optional Range header and returns the response with
// its body read, and the error reading the body.
func get(t *testing.T, s *genmodel.Server, path, rng string) (*http.Response, []byte, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, s.URL()+path, nil)
	require.NoError(t, err)
	if rng != "" {
		req.Header.Set("Range", rng)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp, body, err
}

func TestServerServesFiles(t *testing.T) {
	t.Parallel()
	s, data := serve(t, 1<<20)
	tests := []struct {
		name, path, rng string
		code            int
		body            []byte
		contentRange    string
	}{
		{"whole file", "/model.safetensors", "", http.StatusOK, data, ""},
		{"open range", "/model.safetensors", "bytes=1000-", http.StatusPartialContent, data[1000:], fmt.Sprintf("bytes 1000-%d/%d", len(data)-1, len(data))},
		{"closed range", "/model.safetensors", "bytes=10-19", http.StatusPartialContent, data[10:20], fmt.Sprintf("bytes 10-19/%d", len(data))},
		{"range past the end", "/model.safetensors", fmt.Sprintf("bytes=%d-", len(data)), http.StatusRequestedRangeNotSatisfiable, nil, ""},
		{"missing", "/nope.bin", "", http.StatusNotFound, nil, ""},
		{"root", "/", "", http.StatusNotFound, nil, ""},
		{"escape", "/../../etc/passwd", "", http.StatusNotFound, nil, ""},
		{"escape encoded", "/%2e%2e/%2e%2e/etc/passwd", "", http.StatusNotFound, nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			resp, body, err := get(t, s, tt.path, tt.rng)
			require.NoError(t, err)
			assert.Equal(t, tt.code, resp.StatusCode)
			if tt.body != nil {
				assert.Equal(t, tt.body, body)
			}
			if tt.contentRange != "" {
				assert.Equal(t, tt.contentRange, resp.Header.Get("Content-Range"))
			}
		})
	}
}

func TestServerManifestAndMethods(t *testing.T) {
	t.Parallel()
	s, data := serve(t, 4096)

	resp, body, err := get(t, s, "/"+genmodel.ManifestName, "")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	assert.Contains(t, string(body), `"model.safetensors"`)

	head, err := http.Head(s.URL() + "/model.safetensors")
	require.NoError(t, err)
	head.Body.Close()
	assert.Equal(t, http.StatusOK, head.StatusCode)
	assert.Equal(t, int64(len(data)), head.ContentLength)
	assert.Equal(t, "bytes", head.Header.Get("Accept-Ranges"))

	post, err := http.Post(s.URL()+"/model.safetensors", "text/plain", nil)
	require.NoError(t, err)
	post.Body.Close()
	assert.Equal(t, http.StatusMethodNotAllowed, post.StatusCode)
}

func TestServerCountsBytes(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		opts []genmodel.ServerOption
	}{
		{"sendfile", nil},
		{"paced", []genmodel.ServerOption{genmodel.WithBandwidth(1 << 30)}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s, data := serve(t, 300_000, tt.opts...)
			_, _, err := get(t, s, "/model.safetensors", "")
			require.NoError(t, err)
			_, _, err = get(t, s, "/model.safetensors", "bytes=100000-")
			require.NoError(t, err)
			assert.Equal(t, int64(2*len(data)-100000), s.BytesServed())
			assert.Equal(t, int64(2), s.Requests())
		})
	}
}

func TestServerDrop(t *testing.T) {
	t.Parallel()
	s, data := serve(t, 1<<20, genmodel.WithDrop(genmodel.Fault{Path: "model.safetensors", After: 100_000, Times: 1}))

	resp, body, err := get(t, s, "/model.safetensors", "")
	require.Error(t, err, "the body is cut short")
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, data[:100_000], body)

	// The fault struck once; the next response is whole.
	_, body, err = get(t, s, "/model.safetensors", "bytes=100000-")
	require.NoError(t, err)
	assert.Equal(t, data[100_000:], body)

	// Other files are unaffected.
	_, _, err = get(t, s, "/"+genmodel.ManifestName, "")
	require.NoError(t, err)
}

func TestServerDropEveryResponse(t *testing.T) {
	t.Parallel()
	s, data := serve(t, 200_000, genmodel.WithDrop(genmodel.Fault{After: 50_000}))
	for range 3 {
		_, body, err := get(t, s, "/model.safetensors", "")
		require.Error(t, err)
		assert.Equal(t, data[:50_000], body)
	}
	// A response shorter than After is never struck.
	_, body, err := get(t, s, "/model.safetensors", "bytes=0-999")
	require.NoError(t, err)
	assert.Equal(t, data[:1000], body)
}

func TestServerStall(t *testing.T) {
	t.Parallel()
	s, data := serve(t, 1<<20, genmodel.WithStall(genmodel.Fault{After: 64 << 10, Times: 1}))

	ctx, cancel := context.WithCancel(t.Context())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL()+"/model.safetensors", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	got := make([]byte, 64<<10)
	_, err = io.ReadFull(resp.Body, got)
	require.NoError(t, err)
	assert.Equal(t, data[:64<<10], got)

	// Nothing more arrives until the client gives up.
	more := make(chan error, 1)
	go func() {
		_, err := resp.Body.Read(make([]byte, 1))
		more <- err
	}()
	select {
	case err := <-more:
		t.Fatalf("read after the stall returned %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	cancel()
	require.Error(t, <-more)
	resp.Body.Close()

	_, body, err := get(t, s, "/model.safetensors", "")
	require.NoError(t, err)
	assert.Equal(t, data, body)
}

func TestServerStallReleasedOnShutdown(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, err := genmodel.Generate(dir, genmodel.Spec{Name: "org/m", Files: 1, TotalBytes: 1 << 20})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := genmodel.NewServer(ln, dir, genmodel.WithStall(genmodel.Fault{After: 1000}))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	resp, err := http.Get(s.URL() + "/model.safetensors")
	require.NoError(t, err)
	defer resp.Body.Close()
	_, err = io.ReadFull(resp.Body, make([]byte, 1000))
	require.NoError(t, err)

	start := time.Now()
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
		assert.Less(t, time.Since(start), 4*time.Second, "a stalled response must not hold up shutdown")
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
	}
	_, err = io.ReadAll(resp.Body)
	assert.Error(t, err, "the stalled body ends short")
}

func TestServerCorrupt(t *testing.T) {
	t.Parallel()
	const at = 70_000
	tests := []struct {
		name, rng string
		from      int
	}{
		{"whole file", "", 0},
		{"range covering the byte", "bytes=65536-", 65536},
		{"range starting at the byte", fmt.Sprintf("bytes=%d-", at), at},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s, data := serve(t, 200_000, genmodel.WithCorrupt(genmodel.Fault{After: at, Times: 1}))
			_, body, err := get(t, s, "/model.safetensors", tt.rng)
			require.NoError(t, err)
			want := append([]byte(nil), data[tt.from:]...)
			want[at-tt.from] ^= 0xff
			assert.Equal(t, want, body)

			// A range that misses the byte does not use up the strike.
			_, body, err = get(t, s, "/model.safetensors", "bytes=0-999")
			require.NoError(t, err)
			assert.Equal(t, data[:1000], body)

			_, body, err = get(t, s, "/model.safetensors", tt.rng)
			require.NoError(t, err)
			assert.Equal(t, data[tt.from:], body, "struck once only")
		})
	}
}

func TestServerWithoutRanges(t *testing.T) {
	t.Parallel()
	s, data := serve(t, 100_000, genmodel.WithoutRanges())
	resp, body, err := get(t, s, "/model.safetensors", "bytes=500-")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, data, body)
}

func TestServerBandwidth(t *testing.T) {
	t.Parallel()
	const rate = 2 << 20 // bytes per second
	s, data := serve(t, 1<<20, genmodel.WithBandwidth(rate))
	start := time.Now()
	// Two concurrent downloads share the rate: 2 MiB at 2 MiB/s.
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			_, body, err := get(t, s, "/model.safetensors", "")
			if err == nil && len(body) != len(data) {
				err = fmt.Errorf("got %d bytes", len(body))
			}
			errs <- err
		}()
	}
	require.NoError(t, <-errs)
	require.NoError(t, <-errs)
	elapsed := time.Since(start)
	assert.GreaterOrEqual(t, elapsed, 900*time.Millisecond)
	assert.Less(t, elapsed, 5*time.Second)
}

func TestServerHandler(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, err := genmodel.Generate(dir, genmodel.Spec{Name: "org/m", Files: 2, TotalBytes: 10_000})
	require.NoError(t, err)
	// Run is optional: the server is an http.Handler.
	s := genmodel.NewServer(nil, dir)
	rec := httptest.NewRecorder()
	req, err := http.NewRequest(http.MethodGet, "/config.json", nil)
	require.NoError(t, err)
	s.ServeHTTP(rec, req)
	assert.Equal(t, http.StatusOK, rec.Code)
	assert.Equal(t, 625, rec.Body.Len())
	assert.Equal(t, int64(625), s.BytesServed())
}
