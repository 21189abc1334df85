// Command dramtier measures what the DRAM tier (package pagecache) buys a
// warm server that crashes and reloads its base model: the read throughput
// of a weights file kept by the tier against a cold read from disk.
//
// It writes a file of random bytes (1 GiB by default, -size MiB, -quick for
// 64 MiB) under -dir and fsyncs it. Each run then evicts the file from the
// page cache (posix_fadvise DONTNEED, and also `echo 1 >
// /proc/sys/vm/drop_caches` when that is allowed; stderr says which) and
// reads it all with large sequential reads, the way an inference server
// loads its weights (cold); then evicts it again, keeps it with a tier
// (read back in, and locked where mlock is allowed) and reads it again
// (warm; -mlock=false reads it in without locking it, as where the kernel
// refuses mlock). It prints one JSON line, the medians over -runs:
//
//	{"bench":"dram-tier","warm_gbps":…,"cold_gbps":…,"ratio":…,…}
//
// ratio is warm/cold. On a virtual machine the host may cache the guest's
// disk itself, so that a "cold" read is served from the host's memory.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/pkg/pagecache"
)

type result struct {
	Bench     string  `json:"bench"`
	WarmGBps  float64 `json:"warm_gbps"`
	ColdGBps  float64 `json:"cold_gbps"`
	Ratio     float64 `json:"ratio"`
	Bytes     int64   `json:"bytes"`
	Runs      int     `json:"runs"`
	EvictedBy string  `json:"evicted_by"`
	Locked    bool    `json:"locked"`
}

// readSize is the size of each read: large and sequential.
const readSize = 16 << 20

func main() {
	sizeMiB := flag.Int64("size", 1024, "size of the weights file in MiB")
	quick := flag.Bool("quick", false, "a 64 MiB file and one run")
	runs := flag.Int("runs", 3, "cold and warm reads to take the median of")
	dir := flag.String("dir", os.TempDir(), "directory for the file, on a disk (not tmpfs)")
	mlock := flag.Bool("mlock", true, "let the tier lock the file in memory (false: read in only, as where mlock is refused)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/dramtier: ")
	if *quick {
		*sizeMiB, *runs = 64, 1
	}
	if *sizeMiB < 1 || *runs < 1 {
		log.Fatalf("-size %d and -runs %d must be at least 1", *sizeMiB, *runs)
	}
	size := *sizeMiB << 20

	work, err := os.MkdirTemp(*dir, "weightd-bench-dramtier-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(work)
	path := filepath.Join(work, "model-00001-of-00001.safetensors")
	if err := writeFile(path, size); err != nil {
		log.Fatal(err)
	}

	tier, err := pagecache.New(size, pagecache.WithMlock(*mlock), pagecache.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, nil))))
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	var cold, warm []float64
	var evictedBy string
	var locked bool
	buf := make([]byte, readSize)
	for i := range *runs {
		if evictedBy, err = evict(path); err != nil {
			log.Fatal(err)
		}
		c, err := timedRead(path, buf)
		if err != nil {
			log.Fatal(err)
		}
		if _, err := evict(path); err != nil {
			log.Fatal(err)
		}
		if err := tier.Keep(ctx, "bench", []string{path}); err != nil {
			log.Fatal(err)
		}
		locked = tier.Status().Locked == size
		w, err := timedRead(path, buf)
		if err != nil {
			log.Fatal(err)
		}
		tier.Release("bench")
		cold, warm = append(cold, gbps(size, c)), append(warm, gbps(size, w))
		fmt.Fprintf(os.Stderr, "run %d: cold %.2f GB/s, warm %.2f GB/s (evicted by %s, locked %v)\n", i+1, cold[i], warm[i], evictedBy, locked)
	}
	r := result{
		Bench: "dram-tier", WarmGBps: benchfig.Median(warm), ColdGBps: benchfig.Median(cold),
		Bytes: size, Runs: *runs, EvictedBy: evictedBy, Locked: locked,
	}
	r.Ratio = r.WarmGBps / r.ColdGBps
	if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
		log.Fatal(err)
	}
}

// writeFile writes size random bytes to path and fsyncs it.
func writeFile(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	rng := rand.NewChaCha8([32]byte{7})
	if _, err := io.CopyN(f, rng, size); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return f.Sync()
}

// evict drops path from the page cache and checks that it is gone. It says
// how: "fadvise", or "fadvise+drop_caches" when root may drop every cache.
func evict(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return "", err
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		return "", fmt.Errorf("posix_fadvise(DONTNEED): %w", err)
	}
	how := "fadvise"
	if os.Geteuid() == 0 {
		if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("1\n"), 0); err == nil {
			how = "fadvise+drop_caches"
		} else {
			fmt.Fprintf(os.Stderr, "drop_caches not allowed (%v); posix_fadvise(DONTNEED) only\n", err)
		}
	}
	resident, size, err := pagecache.Resident(path)
	if err != nil {
		return "", err
	}
	if resident > size/100 {
		return "", errors.New("the file stays in the page cache after posix_fadvise(DONTNEED) (tmpfs?): pass -dir on a disk")
	}
	return how, nil
}

// timedRead reads path from start to end in large sequential reads.
func timedRead(path string, buf []byte) (time.Duration, error) {
	start := time.Now()
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	for {
		_, err := io.ReadFull(f, buf)
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return time.Since(start), nil
		}
		if err != nil {
			return 0, fmt.Errorf("reading %s: %w", path, err)
		}
	}
}

func gbps(n int64, d time.Duration) float64 { return float64(n) / 1e9 / d.Seconds() }
