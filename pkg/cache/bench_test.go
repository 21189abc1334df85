package cache

import (
	"context"
	"crypto/sha256"
	"fmt"
	"testing"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/content"
)

// BenchmarkFetch measures verified ingest from memory into the store: the
// ceiling the cache itself sets (hashing, writing, fsync), with no network.
func BenchmarkFetch(b *testing.B) {
	for _, size := range []int{1 << 20, 64 << 20, 256 << 20} {
		data := randomBytes(uint64(size), size)
		desc := descOf(data)
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				b.StopTimer()
				s, err := Open(b.TempDir(), WithBudget(0, 0))
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := s.Fetch(context.Background(), desc, &memSource{data: data}, nil); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				s.Close()
				b.StartTimer()
			}
		})
	}
}

// BenchmarkFetchChunks measures verified ingest chunk by chunk, as the
// swarm fills a download: 4 writers, chunks in order of index within each,
// each checked against its hash before it is written, the whole blob
// hashed behind them and checked before the commit.
func BenchmarkFetchChunks(b *testing.B) {
	const cs = 1 << 20
	for _, size := range []int{64 << 20, 256 << 20} {
		data := randomBytes(uint64(size)+1, size)
		desc := descOf(data)
		sums := make([][]byte, (size+cs-1)/cs)
		for i := range sums {
			sum := sha256.Sum256(chunkOf(data, cs, i))
			sums[i] = sum[:]
		}
		fill := fillerFunc(func(_ context.Context, p *Partial) error {
			var g errgroup.Group
			for w := range 4 {
				g.Go(func() error {
					for i := w; i < p.Chunks(); i += 4 {
						if err := p.WriteChunk(i, chunkOf(data, cs, i), sums[i]); err != nil {
							return err
						}
					}
					return nil
				})
			}
			return g.Wait()
		})
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				b.StopTimer()
				s, err := Open(b.TempDir(), WithBudget(0, 0), WithChunkSize(cs))
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, err := s.Fetch(context.Background(), desc, fill, nil); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				s.Close()
				b.StartTimer()
			}
		})
	}
}

// BenchmarkMaterialize measures laying out a cached model as links: O(files).
// fresh lays the snapshot out each time (its index record is dropped
// between iterations, so the last one is replaced whole: links, fsyncs,
// exchange, ref, record, as every materialisation did before intact
// snapshots were left alone); intact materialises a snapshot already on
// disk, which is checked and left as it is.
func BenchmarkMaterialize(b *testing.B) {
	for _, files := range []int{10, 100, 1000} {
		s, err := Open(b.TempDir(), WithBudget(0, 0))
		if err != nil {
			b.Fatal(err)
		}
		m := content.Model{Name: "bench/m", Revision: "main"}
		for i := range files {
			data := randomBytes(uint64(i), 4096)
			if _, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil); err != nil {
				b.Fatal(err)
			}
			m.Files = append(m.Files, content.File{Path: fmt.Sprintf("d%d/f%d", i%10, i), Descriptor: descOf(data)})
		}
		forget := func() {
			if err := s.db.Update(func(tx *bolt.Tx) error {
				return tx.Bucket(bucketModels).Delete([]byte(m.Name + "@" + m.Revision))
			}); err != nil {
				b.Fatal(err)
			}
		}
		b.Run(fmt.Sprintf("fresh/%dfiles", files), func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				forget()
				b.StartTimer()
				if _, err := s.Materialize(m); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("intact/%dfiles", files), func(b *testing.B) {
			if _, err := s.Materialize(m); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if _, err := s.Materialize(m); err != nil {
					b.Fatal(err)
				}
			}
		})
		s.Close()
	}
}
