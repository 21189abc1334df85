// Package genmodel generates models and serves them over HTTP, for the
// demo, tests and benchmarks: an embedded stand-in for a model's upstream
// (what the swarm calls the origin).
//
// Generate writes a model of random-looking files with realistic names and
// a model.json manifest (the format pkg/prefetch reads). Server serves a
// directory over HTTP with Range support, counts the bytes it sends, and can
// misbehave on purpose: limit its bandwidth, stall, drop connections, corrupt
// bytes or ignore Range, so that downloaders can be tested against an origin
// that fails the way real ones do.
//
// The package depends on no other weightd package, so that any package's
// tests, the cache's included, can use it.
package genmodel

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"runtime"
	"sync"

	"github.com/opencontainers/go-digest"
)

// ManifestName is the name of the manifest Generate writes beside the files.
const ManifestName = "model.json"

// MaxFiles is the most files Generate writes (the manifest format's limit).
const MaxFiles = 100_000

// Spec describes a model to generate.
type Spec struct {
	Name       string // "org/name", a valid model name
	Files      int    // at least 1
	TotalBytes int64  // sum of the file sizes, at least 0
	Seed       uint64 // the same spec always yields the same bytes
}

// Manifest is what Generate wrote: the JSON of model.json.
type Manifest struct {
	Name     string `json:"name"`
	Revision string `json:"revision"`
	Files    []File `json:"files"`
}

// File is one generated file.
type File struct {
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"` // 64 lowercase hex digits
}

// Digest returns the file's digest ("sha256:" + SHA256).
func (f File) Digest() digest.Digest {
	return digest.NewDigestFromEncoded(digest.SHA256, f.SHA256)
}

// TotalBytes returns the sum of the files' sizes.
func (m *Manifest) TotalBytes() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}

// Generate writes the model spec describes into dir (created if needed) and
// its manifest as dir/model.json, and returns the manifest.
//
// The files are named like a Hugging Face model: with one file, only
// "model.safetensors"; with more, "config.json" (TotalBytes/16, at most 4 KiB),
// then "tokenizer.json" (TotalBytes/8, at most 4 MiB), then the rest split
// evenly over "model-00001-of-0000N.safetensors" shards (or one
// "model.safetensors"). Sizes sum exactly to TotalBytes. Every file, JSON
// names included, holds a wyrand stream seeded from Seed and the file's
// index: random-looking, never zeros, incompressible, deterministic. Each file is
// hashed as it is written (one pass); files are written in parallel. The
// revision is 40 hex digits derived from the content, like a commit.
func Generate(dir string, spec Spec) (*Manifest, error) {
	if err := spec.validate(); err != nil {
		return nil, fmt.Errorf("generating model in %s: %w", dir, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("generating model: %w", err)
	}
	m := &Manifest{Name: spec.Name, Files: layout(spec.Files, spec.TotalBytes)}

	var (
		wg      sync.WaitGroup
		errMu   sync.Mutex
		errs    []error
		indices = make(chan int)
	)
	for range min(runtime.GOMAXPROCS(0), len(m.Files)) {
		wg.Go(func() {
			for i := range indices {
				sum, err := writeFile(filepath.Join(dir, m.Files[i].Path), m.Files[i].Size, spec.Seed, uint64(i))
				if err != nil {
					errMu.Lock()
					errs = append(errs, err)
					errMu.Unlock()
					continue
				}
				m.Files[i].SHA256 = sum
			}
		})
	}
	for i := range m.Files {
		indices <- i
	}
	close(indices)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("generating model in %s: %w", dir, err)
	}

	rev := sha256.New()
	fmt.Fprintf(rev, "%s\n", m.Name)
	for _, f := range m.Files {
		fmt.Fprintf(rev, "%s %d %s\n", f.Path, f.Size, f.SHA256)
	}
	m.Revision = hex.EncodeToString(rev.Sum(nil))[:40]

	data, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("generating model: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, ManifestName), append(data, '\n'), 0o644); err != nil {
		return nil, fmt.Errorf("generating model: %w", err)
	}
	return m, nil
}

func (s Spec) validate() error {
	switch {
	case s.Name == "":
		return errors.New("spec: empty name")
	case s.Files < 1 || s.Files > MaxFiles:
		return fmt.Errorf("spec: %d files, want 1 to %d", s.Files, MaxFiles)
	case s.TotalBytes < 0:
		return fmt.Errorf("spec: negative size %d", s.TotalBytes)
	}
	return nil
}

// layout names the files and sizes them; see Generate.
func layout(files int, total int64) []File {
	var out []File
	rest := total
	if files > 1 {
		n := min(total/16, 4<<10)
		out = append(out, File{Path: "config.json", Size: n})
		rest -= n
	}
	if files > 2 {
		n := min(total/8, 4<<20)
		out = append(out, File{Path: "tokenizer.json", Size: n})
		rest -= n
	}
	shards := files - len(out)
	base, extra := rest/int64(shards), rest%int64(shards)
	for i := range shards {
		name := "model.safetensors"
		if shards > 1 {
			name = fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, shards)
		}
		size := base
		if int64(i) < extra {
			size++
		}
		out = append(out, File{Path: name, Size: size})
	}
	return out
}

// writeFile writes size bytes of the random stream for (seed, index) to
// name and returns their hex sha256. Generating and hashing run beside
// writing, so one file keeps two cores busy.
func writeFile(name string, size int64, seed, index uint64) (sum string, err error) {
	f, err := os.Create(name)
	if err != nil {
		return "", err
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = cerr
		}
	}()

	const bufSize, bufs = 1 << 20, 3
	free := make(chan []byte, bufs)
	for range bufs {
		free <- make([]byte, bufSize)
	}
	full := make(chan []byte, bufs)
	stop := make(chan struct{})
	h := sha256.New()
	go func() {
		defer close(full)
		state := mix(seed ^ mix(index+1))
		for left := size; left > 0; {
			var b []byte
			select {
			case b = <-free:
			case <-stop:
				return
			}
			b = b[:min(int64(bufSize), left)]
			state = fill(b, state)
			h.Write(b)
			full <- b
			left -= int64(len(b))
		}
	}()
	for b := range full {
		if _, err := f.Write(b); err != nil {
			close(stop)
			for range full { // let the generator finish its piece and exit
			}
			return "", err
		}
		free <- b[:cap(b)]
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// fill fills b with the wyrand stream from state and returns the next state.
// wyrand is not cryptographic but passes BigCrush and runs at several GB/s:
// its output looks random and does not compress.
func fill(b []byte, state uint64) uint64 {
	var word [8]byte
	for i := 0; i < len(b); i += 8 {
		state += 0xa0761d6478bd642f
		hi, lo := bits.Mul64(state, state^0xe7037ed1a0b428db)
		if i+8 <= len(b) {
			binary.LittleEndian.PutUint64(b[i:], hi^lo)
		} else {
			binary.LittleEndian.PutUint64(word[:], hi^lo)
			copy(b[i:], word[:])
		}
	}
	return state
}

// mix is splitmix64's finaliser: it spreads seeds that differ in a few bits
// into unrelated starting states.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}
