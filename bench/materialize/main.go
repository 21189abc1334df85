// Command materialize measures handing an already cached model to a pod:
// materialising a 100-file model as a directory of links into the cache.
//
// It fills a store with the model's blobs, then times Store.Materialize and
// measures the bytes it copied: the size of every regular file (not a link)
// under the model directory, which must be 0, and the bytes the process wrote
// through write system calls meanwhile (the index update), from
// /proc/self/io. It prints one JSON line:
//
//	{"bench":"materialize","files":100,"seconds":…,"bytes_copied":0,"model_bytes":…,"syscall_write_bytes":…}
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

type result struct {
	Bench             string  `json:"bench"`
	Files             int     `json:"files"`
	Seconds           float64 `json:"seconds"`
	BytesCopied       int64   `json:"bytes_copied"`
	ModelBytes        int64   `json:"model_bytes"`
	SyscallWriteBytes int64   `json:"syscall_write_bytes"`
}

func main() {
	files := flag.Int("files", 100, "files in the model")
	fileSize := flag.Int("file-kib", 1024, "size of each file in KiB")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/materialize: ")

	root, err := os.MkdirTemp("", "weightd-bench-materialize-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)
	s, err := cache.Open(root)
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	m := content.Model{Name: "bench/materialize", Revision: "main"}
	rng := rand.NewChaCha8([32]byte{42})
	buf := make([]byte, *fileSize<<10)
	for i := range *files {
		_, _ = rng.Read(buf) // ChaCha8.Read never fails
		desc := content.Descriptor{Digest: digest.FromBytes(buf), Size: int64(len(buf))}
		if _, err := s.Fetch(context.Background(), desc, memory(bytes.Clone(buf)), nil); err != nil {
			log.Fatal(err)
		}
		m.Files = append(m.Files, content.File{Path: fmt.Sprintf("shards/model-%05d-of-%05d.safetensors", i+1, *files), Descriptor: desc})
	}

	before, err := writtenBytes()
	if err != nil {
		log.Fatal(err)
	}
	start := time.Now()
	dir, err := s.Materialize(m)
	took := time.Since(start)
	if err != nil {
		log.Fatal(err)
	}
	after, err := writtenBytes()
	if err != nil {
		log.Fatal(err)
	}
	copied, linked, err := walk(dir)
	if err != nil {
		log.Fatal(err)
	}
	if linked != *files {
		log.Fatalf("found %d links in %s, want %d", linked, dir, *files)
	}
	if err := json.NewEncoder(os.Stdout).Encode(result{
		Bench: "materialize", Files: *files, Seconds: float64(took.Microseconds()) / 1e6,
		BytesCopied: copied, ModelBytes: int64(*files) * int64(len(buf)), SyscallWriteBytes: after - before,
	}); err != nil {
		log.Fatal(err)
	}
}

// walk sums the sizes of regular files under dir and counts the links that
// resolve to a readable file.
func walk(dir string) (copied int64, links int, err error) {
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			if _, err := os.Stat(p); err != nil {
				return fmt.Errorf("dangling link %s: %w", p, err)
			}
			links++
		case d.Type().IsRegular():
			info, err := d.Info()
			if err != nil {
				return err
			}
			copied += info.Size()
		}
		return nil
	})
	return copied, links, err
}

// writtenBytes is the bytes this process has passed to write system calls.
func writtenBytes() (int64, error) {
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "wchar: "); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("no wchar in /proc/self/io")
}

// memory is a blob source that is already in memory.
type memory []byte

func (m memory) OpenRange(_ context.Context, off int64) (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(m[off:])), nil
}
