package hubtest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// Content is the bytes of one file in a repository. ReadAt must be safe for
// concurrent use; the hub never holds more than a buffer of it in memory.
type Content interface {
	io.ReaderAt
	Size() int64
}

// Bytes is content held in memory (a copy of b).
func Bytes(b []byte) Content { return bytes.NewReader(bytes.Clone(b)) }

// String is content held in memory.
func String(s string) Content { return bytes.NewReader([]byte(s)) }

// Generated is size bytes of deterministic pseudo-random content, the same
// for the same size and seed, computed on demand: a benchmark can serve
// gigabytes of it without holding them.
func Generated(size int64, seed uint64) Content {
	if size < 0 {
		panic(fmt.Sprintf("hubtest: negative size %d", size))
	}
	return generated{size: size, seed: seed}
}

type generated struct {
	size int64
	seed uint64
}

func (g generated) Size() int64 { return g.size }

// ReadAt fills p with the bytes at off: each 8-byte word at index i is a
// splitmix64 of the seed and i, little-endian.
func (g generated) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, errors.New("hubtest: negative offset")
	}
	if off >= g.size {
		return 0, io.EOF
	}
	n := len(p)
	if rest := g.size - off; int64(n) > rest {
		n = int(rest)
	}
	key := g.seed * 0x9e3779b97f4a7c15
	var word [8]byte
	for i := 0; i < n; {
		pos := off + int64(i)
		if pos%8 == 0 && n-i >= 8 {
			// Whole words straight into p.
			w := uint64(pos / 8)
			for ; n-i >= 8; i, w = i+8, w+1 {
				binary.LittleEndian.PutUint64(p[i:], splitmix64(key^w))
			}
			continue
		}
		binary.LittleEndian.PutUint64(word[:], splitmix64(key^uint64(pos/8)))
		i += copy(p[i:n], word[pos%8:])
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func splitmix64(x uint64) uint64 {
	z := x + 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// FromFile is the content of the file at path, read from disk as it is
// served. The file is opened now and closed by Hub.Close (of the hub it was
// added to); it must not change meanwhile.
func FromFile(path string) (Content, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("hubtest: %s is not a regular file", path)
	}
	return &fileContent{File: f, size: fi.Size()}, nil
}

type fileContent struct {
	*os.File
	size int64
}

func (f *fileContent) Size() int64 { return f.size }

// Storage says how a file is stored in the repository's git history.
type Storage int

// Storages.
const (
	// Auto stores a file with LFS when its name matches the hub's default
	// .gitattributes patterns (*.safetensors, *.bin, *.gguf, …) or it is 10 MiB
	// or larger, and in git otherwise.
	Auto Storage = iota
	// Git stores the file in git: served directly, its ETag its git blob id.
	Git
	// LFS stores the file with Git LFS: the resolve endpoint redirects to
	// the CDN and the listing carries its sha256.
	LFS
)

// As wraps c so that it is stored as s regardless of its name and size.
func As(s Storage, c Content) Content { return stored{Content: c, storage: s} }

type stored struct {
	Content
	storage Storage
}

// corrupt serves c with every byte inverted: same size, wrong bytes.
type corrupt struct{ Content }

func (c corrupt) ReadAt(p []byte, off int64) (int, error) {
	n, err := c.Content.ReadAt(p, off)
	for i := range p[:n] {
		p[i] ^= 0xff
	}
	return n, err
}
