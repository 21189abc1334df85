package hf_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/hf"
)

// BenchmarkFetch resolves a two-file model on an in-process hub, fetches it
// into a fresh store through the CDN redirect and materialises it.
func BenchmarkFetch(b *testing.B) {
	for _, size := range []int64{1 << 20, 64 << 20, 256 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			hub := hubtest.New()
			defer hub.Close()
			hub.AddRepo("org/model", map[string]hubtest.Content{
				"config.json":       hubtest.String(`{"model_type": "llama"}`),
				"model.safetensors": hubtest.Generated(size, 1),
			})
			src, err := hf.New(nil, hf.WithEndpoint(hub.URL))
			if err != nil {
				b.Fatal(err)
			}
			r, err := ref.Parse("hf://org/model")
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(size)
			for b.Loop() {
				dir, err := os.MkdirTemp(b.TempDir(), "store-")
				if err != nil {
					b.Fatal(err)
				}
				store, err := cache.Open(dir)
				if err != nil {
					b.Fatal(err)
				}
				res, err := src.Resolve(b.Context(), r)
				if err != nil {
					b.Fatal(err)
				}
				for _, f := range res.Model.Files {
					if _, err := store.Fetch(b.Context(), f.Descriptor, res.Blobs[f.Digest], nil); err != nil {
						b.Fatal(err)
					}
				}
				if _, err := store.Materialize(res.Model); err != nil {
					b.Fatal(err)
				}
				store.Close()
				os.RemoveAll(dir)
			}
		})
	}
}
