package cache

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// EventKind says what happened to a blob.
type EventKind int

// The events a store reports through WithEvents.
const (
	EventPartial  EventKind = iota + 1 // a download started: chunks will become servable
	EventChunk                         // one more chunk of a download is present and verified
	EventComplete                      // the blob is complete and verified
	EventRemoved                       // the blob (or its download) is gone
)

// Event is one change in what the store can serve.
type Event struct {
	Kind   EventKind
	Digest digest.Digest
	Chunk  int // with EventChunk
}

func (s *Store) emit(e Event) {
	if s.opts.events != nil {
		s.opts.events(e)
	}
}

// ChunkState is what the store can serve of one blob: which chunks are
// present and verified, and the hash of each (zero where absent).
type ChunkState struct {
	Size      int64  `json:"size"`
	ChunkSize int64  `json:"chunkSize"`
	Complete  bool   `json:"complete"`
	Have      []byte `json:"have"`   // bitmap, bit i (LSB first) = chunk i present
	Hashes    []byte `json:"hashes"` // sha256 of chunk i at [32i, 32i+32)
}

// Has reports whether chunk i is present.
func (c ChunkState) Has(i int) bool {
	return i >= 0 && i/8 < len(c.Have) && c.Have[i/8]&(1<<(i%8)) != 0
}

// Hash returns the hash of chunk i, or nil where it is not present.
func (c ChunkState) Hash(i int) []byte {
	if !c.Has(i) || (i+1)*sha256.Size > len(c.Hashes) {
		return nil
	}
	return c.Hashes[i*sha256.Size : (i+1)*sha256.Size]
}

// ChunkState reports the chunks of d this store can serve: all of a complete
// blob, or the verified chunks of a download in flight. ErrNotFound otherwise.
func (s *Store) ChunkState(d digest.Digest) (ChunkState, error) {
	if err := content.ValidateDigest(d); err != nil {
		return ChunkState{}, err
	}
	if p := s.inFlight(d); p != nil {
		have, hashes := p.state()
		return ChunkState{Size: p.desc.Size, ChunkSize: p.cs, Have: have, Hashes: hashes}, nil
	}
	info, err := s.Stat(d)
	if err != nil {
		return ChunkState{}, err
	}
	cs, hashes, err := s.chunkHashes(d)
	if err != nil {
		return ChunkState{}, err
	}
	n := chunkCount(info.Size, cs)
	have := bytes.Repeat([]byte{0xff}, (n+7)/8)
	if n%8 != 0 {
		have[len(have)-1] = 1<<(n%8) - 1
	}
	return ChunkState{Size: info.Size, ChunkSize: cs, Complete: true, Have: have, Hashes: hashes}, nil
}

// OpenChunk opens chunk i of d for reading, from the complete blob or from a
// download in flight once that chunk is verified. The chunk is the bytes
// [off, off+n) of the returned file, which the caller closes; the file stays
// readable even if the blob is committed or evicted meanwhile.
func (s *Store) OpenChunk(d digest.Digest, i int) (f *os.File, off, n int64, err error) {
	if err := content.ValidateDigest(d); err != nil {
		return nil, 0, 0, err
	}
	if p := s.inFlight(d); p != nil {
		if !p.Has(i) {
			return nil, 0, 0, fmt.Errorf("chunk %d of %s: %w", i, d, content.ErrNotFound)
		}
		// Open by path: a fresh descriptor the caller may seek and close.
		f, err := os.Open(s.partialData(d))
		if errors.Is(err, os.ErrNotExist) {
			// Committed (renamed) between the check and the open.
			p, _ := s.BlobPath(d)
			f, err = os.Open(p)
		}
		if err != nil {
			return nil, 0, 0, fmt.Errorf("chunk %d of %s: %w", i, d, content.ErrNotFound)
		}
		return f, int64(i) * p.cs, p.ChunkLen(i), nil
	}
	cs, _, err := s.chunkHashes(d)
	if err != nil {
		return nil, 0, 0, err
	}
	info, _ := s.Stat(d)
	if i < 0 || i >= chunkCount(info.Size, cs) {
		return nil, 0, 0, fmt.Errorf("chunk %d of %s: %w", i, d, content.ErrNotFound)
	}
	if f, err = s.Open(d); err != nil {
		return nil, 0, 0, err
	}
	off = int64(i) * cs
	return f, off, min(cs, info.Size-off), nil
}

// ChunkHash returns the sha256 of chunk i of d, of the complete blob or of a
// download in flight once that chunk is verified; ErrNotFound otherwise.
func (s *Store) ChunkHash(d digest.Digest, i int) ([]byte, error) {
	if err := content.ValidateDigest(d); err != nil {
		return nil, err
	}
	if p := s.inFlight(d); p != nil {
		if h := p.Hash(i); h != nil {
			return h, nil
		}
		return nil, fmt.Errorf("chunk %d of %s: %w", i, d, content.ErrNotFound)
	}
	_, hashes, err := s.chunkHashes(d)
	if err != nil {
		return nil, err
	}
	if i < 0 || (i+1)*sha256.Size > len(hashes) {
		return nil, fmt.Errorf("chunk %d of %s: %w", i, d, content.ErrNotFound)
	}
	return bytes.Clone(hashes[i*sha256.Size : (i+1)*sha256.Size]), nil
}

// inFlight returns the partial of a download in progress, or nil.
func (s *Store) inFlight(d digest.Digest) *Partial {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if f := s.flights[d]; f != nil {
		return f.partial
	}
	return nil
}
