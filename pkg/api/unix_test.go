package api

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

func TestParseAddr(t *testing.T) {
	t.Parallel()
	tests := []struct {
		addr, network, address string
	}{
		{"unix:///run/weightd/weightd.sock", "unix", "/run/weightd/weightd.sock"},
		{"unix:///tmp/../tmp/x.sock", "unix", "/tmp/x.sock"},
		{"tcp://127.0.0.1:9000", "tcp", "127.0.0.1:9000"},
		{"http://127.0.0.1:9000", "tcp", "127.0.0.1:9000"},
		{"http://[::1]:9000/", "tcp", "[::1]:9000"},
		{"unix://relative.sock", "", ""},
		{"unix:relative.sock", "", ""},
		{"tcp://127.0.0.1", "", ""},
		{"http://127.0.0.1:9000/v1", "", ""},
		{"https://127.0.0.1:9000", "", ""},
		{"/run/weightd.sock", "", ""},
		{"", "", ""},
	}
	for _, tt := range tests {
		network, address, err := ParseAddr(tt.addr)
		if tt.network == "" {
			if !errors.Is(err, ErrInvalidAddr) {
				t.Errorf("ParseAddr(%q) = %q, %q, %v; want ErrInvalidAddr", tt.addr, network, address, err)
			}
			continue
		}
		if err != nil || network != tt.network || address != tt.address {
			t.Errorf("ParseAddr(%q) = %q, %q, %v; want %q, %q", tt.addr, network, address, err, tt.network, tt.address)
		}
	}
}

func TestListenUnixSocket(t *testing.T) {
	t.Parallel()
	dir := testdisk.ShortDir(t)
	path := filepath.Join(dir, "run", "weightd.sock") // parent does not exist yet
	addr := "unix://" + path

	ln, err := Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != SocketMode {
		t.Fatalf("socket mode %v, want a socket with %o", fi.Mode(), SocketMode)
	}
	// A socket some process answers on is not replaced.
	if _, err := Listen(addr); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("Listen on a live socket = %v, want an in-use error", err)
	}
	// A socket left behind by a crash is stale and replaced.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the stale socket should still exist: %v", err)
	}
	ln, err = Listen(addr)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	ln.Close()
	// A regular file is never removed.
	if err := os.WriteFile(path, []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(addr); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Fatalf("Listen over a regular file = %v, want an error", err)
	}
}

// testOrigin serves a manifest and its files; it returns the manifest's URL.
func testOrigin(t *testing.T, files map[string][]byte) string {
	t.Helper()
	m := httpsource.Manifest{Name: "test/model", Revision: "main"}
	mux := http.NewServeMux()
	for name, data := range files {
		sum := sha256.Sum256(data)
		m.Files = append(m.Files, httpsource.ManifestFile{Path: name, Size: int64(len(data)), SHA256: hex.EncodeToString(sum[:])})
		mux.HandleFunc("/m/"+name, func(w http.ResponseWriter, r *http.Request) {
			http.ServeContent(w, r, name, time.Time{}, strings.NewReader(string(data)))
		})
	}
	manifest, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	mux.HandleFunc("/m/model.json", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(manifest) })
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	return ts.URL + "/m/model.json"
}

// TestOverUnixSocketWithQueue runs the real queue and cache behind the server
// on a unix socket and fetches a model through the client.
func TestOverUnixSocketWithQueue(t *testing.T) {
	t.Parallel()
	data := make([]byte, 3<<20)
	rand.Read(data)
	ref := testOrigin(t, map[string][]byte{"model.safetensors": data, "config.json": []byte(`{"a":1}`)})

	store, err := cache.Open(t.TempDir(), cache.WithChunkSize(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	q := prefetch.NewQueue(store, httpsource.New(nil))
	srv, err := NewServer(QueueJobs(q), store)
	if err != nil {
		t.Fatal(err)
	}
	addr := "unix://" + filepath.Join(testdisk.ShortDir(t), "weightd.sock")
	ln, err := Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: srv}
	ctx, cancel := context.WithCancel(t.Context())
	queueDone := make(chan error, 1)
	go func() { queueDone <- q.Run(ctx) }()
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	defer func() {
		cancel()
		hs.Close()
		if err := <-queueDone; err != nil {
			t.Errorf("queue: %v", err)
		}
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serving: %v", err)
		}
	}()

	c, err := NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Fetch(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	final, err := c.Watch(ctx, st.ID, nil)
	if err != nil {
		t.Fatal(err)
	}
	if final.State != prefetch.StateReady || final.BytesDone != final.BytesTotal || final.FilesDone != 2 {
		t.Fatalf("final status %+v", final)
	}
	got, err := os.ReadFile(filepath.Join(final.Dir, "model.safetensors"))
	if err != nil || string(got) != string(data) {
		t.Fatalf("model file: %d bytes, %v", len(got), err)
	}
	status, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if status.Cache.Blobs != 2 || status.Cache.Bytes != int64(len(data))+7 || len(status.Jobs) != 1 {
		t.Fatalf("status %+v", status)
	}
	// Watching a finished job returns its final status at once.
	again, err := c.Watch(ctx, st.ID, nil)
	if err != nil || again.State != prefetch.StateReady {
		t.Fatalf("second watch = %+v, %v", again, err)
	}
}
