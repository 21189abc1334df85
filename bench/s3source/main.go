// Command s3source measures the S3 model source against the cache's own
// ingest, on the same bytes in the same run. One generated model (1 GiB in
// 6 files by default, with its model.json) is put into an S3-compatible
// server on loopback (internal/s3test: gofakes3 over memory, real HTTP),
// then, each round and each into an empty cache:
//
//   - ingest: every file goes into the cache (cache.Store.Fetch: hashed,
//     verified, fsynced, committed) from a local reader over the generated
//     file: the cache's own speed, the baseline;
//   - s3: s3.Source resolves s3://bench/model (its model.json) and every
//     blob goes into the cache through the source's ranged GetObject
//     openers, the same Fetch call.
//
// Both sides fetch -concurrency files at a time (default: the queue's,
// prefetch.DefaultFileConcurrency, as an agent fetches a model).
//
// It prints one line:
//
//	{"bench":"model-source","source":"s3","size_bytes":…,"files":…,"concurrency":…,"seconds":…,"ingest_seconds":…,"ratio_vs_ingest":…}
//
// with ratio_vs_ingest = S3 throughput / ingest throughput =
// ingest_seconds / seconds (1.0: the S3 path costs nothing over ingest).
// Each side's best of -rounds counts; the sides alternate within a round.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/s3test"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/s3"
)

type result struct {
	Bench         string  `json:"bench"`
	Source        string  `json:"source"`
	SizeBytes     int64   `json:"size_bytes"`
	Files         int     `json:"files"`
	Concurrency   int     `json:"concurrency"`
	Seconds       float64 `json:"seconds"`
	IngestSeconds float64 `json:"ingest_seconds"`
	RatioVsIngest float64 `json:"ratio_vs_ingest"`
}

func main() {
	sizeMiB := flag.Int64("size-mib", 1024, "model size, MiB")
	files := flag.Int("files", 6, "model files")
	rounds := flag.Int("rounds", 3, "rounds; each side's best counts")
	concurrency := flag.Int("concurrency", prefetch.DefaultFileConcurrency, "files fetched at a time, on both sides")
	dir := flag.String("dir", "", "working directory, on the disk to measure (default: a new temporary directory, removed at the end)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/s3source: ")
	if *sizeMiB < 1 || *files < 1 || *rounds < 1 || *concurrency < 1 {
		log.Fatal("-size-mib, -files, -rounds and -concurrency must be positive")
	}
	work := *dir
	if work == "" {
		var err error
		if work, err = os.MkdirTemp("", "weightd-bench-s3-"); err != nil {
			log.Fatal(err)
		}
		defer os.RemoveAll(work)
	}
	if err := run(context.Background(), work, *sizeMiB<<20, *files, *rounds, *concurrency); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, work string, size int64, files, rounds, concurrency int) error {
	modelDir := filepath.Join(work, "model")
	m, err := genmodel.Generate(modelDir, genmodel.Spec{Name: "bench/model", Files: files, TotalBytes: size, Seed: 42})
	if err != nil {
		return err
	}
	srv, err := s3test.Start()
	if err != nil {
		return err
	}
	defer srv.Close()
	if err := srv.CreateBucket(ctx, "bench", false); err != nil {
		return err
	}
	for _, p := range append([]string{genmodel.ManifestName}, paths(m)...) {
		data, err := os.ReadFile(filepath.Join(modelDir, p))
		if err != nil {
			return err
		}
		if _, err := srv.Put(ctx, "bench", "model/"+p, data); err != nil {
			return fmt.Errorf("putting %s: %w", p, err)
		}
	}
	src, err := s3.New(nil, s3.WithEndpoint(srv.URL), s3.WithPathStyle(true),
		s3.WithCredentials(credentials.NewStaticCredentialsProvider("bench", "bench", "")))
	if err != nil {
		return err
	}
	parsed, err := ref.Parse("s3://bench/model")
	if err != nil {
		return err
	}

	var bestIngest, bestS3 time.Duration
	for r := range rounds {
		ingest, err := timed(filepath.Join(work, fmt.Sprintf("ingest%d", r)), func(store *cache.Store) error {
			openers := make(map[digest.Digest]content.RangeOpener, len(m.Files))
			descs := make([]content.Descriptor, len(m.Files))
			for i, f := range m.Files {
				descs[i] = content.Descriptor{Digest: f.Digest(), Size: f.Size}
				openers[f.Digest()] = fileOpener(filepath.Join(modelDir, f.Path))
			}
			return fetchAll(ctx, store, descs, openers, concurrency)
		})
		if err != nil {
			return fmt.Errorf("ingest: %w", err)
		}
		s3, err := timed(filepath.Join(work, fmt.Sprintf("s3-%d", r)), func(store *cache.Store) error {
			res, err := src.Resolve(ctx, parsed)
			if err != nil {
				return err
			}
			descs := make([]content.Descriptor, len(res.Model.Files))
			for i, f := range res.Model.Files {
				descs[i] = f.Descriptor
			}
			return fetchAll(ctx, store, descs, res.Blobs, concurrency)
		})
		if err != nil {
			return fmt.Errorf("s3: %w", err)
		}
		log.Printf("round %d: ingest %.2f s, s3 %.2f s", r+1, ingest.Seconds(), s3.Seconds())
		if r == 0 || ingest < bestIngest {
			bestIngest = ingest
		}
		if r == 0 || s3 < bestS3 {
			bestS3 = s3
		}
	}
	return json.NewEncoder(os.Stdout).Encode(result{
		Bench: "model-source", Source: "s3", SizeBytes: m.TotalBytes(), Files: len(m.Files), Concurrency: concurrency,
		Seconds: benchfig.Round(bestS3.Seconds(), 3), IngestSeconds: benchfig.Round(bestIngest.Seconds(), 3),
		RatioVsIngest: benchfig.Round(bestIngest.Seconds()/bestS3.Seconds(), 3),
	})
}

// fetchAll fetches every blob into store, n at a time.
func fetchAll(ctx context.Context, store *cache.Store, descs []content.Descriptor, openers map[digest.Digest]content.RangeOpener, n int) error {
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(n)
	for _, d := range descs {
		g.Go(func() error {
			_, err := store.Fetch(ctx, d, openers[d.Digest], nil)
			return err
		})
	}
	return g.Wait()
}

// timed runs fill on an empty store at root and returns how long it took;
// the store is removed afterwards.
func timed(root string, fill func(*cache.Store) error) (time.Duration, error) {
	store, err := cache.Open(root)
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(root)
	defer store.Close()
	syscall.Sync() // the previous side's write-back does not count against this one
	start := time.Now()
	if err := fill(store); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

func paths(m *genmodel.Manifest) []string {
	ps := make([]string, len(m.Files))
	for i, f := range m.Files {
		ps[i] = f.Path
	}
	return ps
}

// fileOpener reads a local file from any offset: the cache's ingest with
// no network in the way.
type fileOpener string

func (p fileOpener) OpenRange(_ context.Context, off int64) (io.ReadCloser, error) {
	f, err := os.Open(string(p))
	if err != nil {
		return nil, err
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}
