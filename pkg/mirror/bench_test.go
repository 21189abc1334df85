package mirror

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// BenchmarkServeBlob measures a blob GET through the mirror over loopback
// HTTP: from the cache (sendfile), and streamed while the cache fetches it
// from an in-memory upstream.
func BenchmarkServeBlob(b *testing.B) {
	for _, size := range []int{1 << 20, 16 << 20} {
		data := randomBytes(3, size)
		d := digest.FromBytes(data)
		up := newFakeUpstream()
		up.blobs[d] = data
		b.Run(fmt.Sprintf("cache/%dMiB", size>>20), func(b *testing.B) {
			store, err := cache.Open(b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			defer store.Close()
			if _, err := store.Fetch(b.Context(), content.Descriptor{Digest: d, Size: int64(size)}, cache.Bytes(data), nil); err != nil {
				b.Fatal(err)
			}
			url, done := benchServer(b, store, up)
			defer done()
			b.SetBytes(int64(size))
			for b.Loop() {
				benchGet(b, url+"/v2/a/blobs/"+d.String(), size)
			}
		})
		b.Run(fmt.Sprintf("fetch/%dMiB", size>>20), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				b.StopTimer()
				store, err := cache.Open(b.TempDir(), cache.WithChunkSize(1<<20))
				if err != nil {
					b.Fatal(err)
				}
				url, done := benchServer(b, store, up)
				b.StartTimer()
				benchGet(b, url+"/v2/a/blobs/"+d.String(), size)
				b.StopTimer()
				done()
				store.Close()
				b.StartTimer()
			}
		})
	}
}

func benchServer(b *testing.B, store *cache.Store, up *fakeUpstream) (string, func()) {
	m, err := New(store, up, WithRegistries("docker.io"), WithRegisterer(prometheus.NewRegistry()))
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(m)
	return srv.URL, func() { srv.Close(); m.Close() }
}

func benchGet(b *testing.B, url string, size int) {
	resp, err := http.Get(url)
	if err != nil {
		b.Fatal(err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil || n != int64(size) {
		b.Fatalf("%d bytes, %v", n, err)
	}
}
