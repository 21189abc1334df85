package warmpool

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// cachedAdapter puts files into a real cache and returns the model's
// snapshot (links into the cache's blobs) and a plain copy of the same files.
func cachedAdapter(tb testing.TB, files map[string][]byte) (snapshot, plain string) {
	tb.Helper()
	store, err := cache.Open(filepath.Join(tb.TempDir(), "cache"))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { store.Close() })
	m := content.Model{Name: "org/adapter", Revision: "main"}
	plain = tb.TempDir()
	for p, data := range files {
		info, err := store.Put(context.Background(), bytes.NewReader(data), int64(len(data)))
		if err != nil {
			tb.Fatal(err)
		}
		m.Files = append(m.Files, content.File{Path: p, Descriptor: info.Descriptor})
		if err := os.MkdirAll(filepath.Dir(filepath.Join(plain, p)), 0o755); err != nil {
			tb.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(plain, p), data, 0o644); err != nil {
			tb.Fatal(err)
		}
	}
	if snapshot, err = store.Materialize(m); err != nil {
		tb.Fatal(err)
	}
	return snapshot, plain
}

// TestContentDigestOfCachedFiles names a cached adapter by its blobs'
// digests without reading them, and the name is the one its bytes give: the
// same files copied out of the cache have the same digest, and changed
// bytes another.
func TestContentDigestOfCachedFiles(t *testing.T) {
	t.Parallel()
	files := map[string][]byte{"adapter_config.json": []byte(`{"r":8}`), "adapter_model.safetensors": bytes.Repeat([]byte{7}, 1<<20)}
	snapshot, plain := cachedAdapter(t, files)
	fromLinks, err := contentDigest(snapshot)
	if err != nil {
		t.Fatal(err)
	}
	fromBytes, err := contentDigest(plain)
	if err != nil {
		t.Fatal(err)
	}
	if fromLinks != fromBytes {
		t.Fatalf("a cached adapter's digest %s, its bytes' %s", fromLinks, fromBytes)
	}
	if err := os.WriteFile(filepath.Join(plain, "adapter_config.json"), []byte(`{"r":16}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if changed, err := contentDigest(plain); err != nil || changed == fromBytes {
		t.Fatalf("changed bytes give digest %s (%v), the same as before", changed, err)
	}
}

// BenchmarkContentDigest names a 64 MiB adapter from the cache's links
// against hashing the same files' bytes.
func BenchmarkContentDigest(b *testing.B) {
	snapshot, plain := cachedAdapter(b, map[string][]byte{
		"adapter_config.json": []byte(`{"r":8}`), "adapter_model.safetensors": bytes.Repeat([]byte{7}, 64<<20)})
	for _, bc := range []struct{ name, dir string }{{"cached", snapshot}, {"bytes", plain}} {
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := contentDigest(bc.dir); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
