package cache

import (
	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// ChunkMap is ChunkState without the hashes: it appends to buf[:0] the
// bitmap of the chunks of d this store can serve, of a download in
// flight, and returns it; for a complete blob it returns complete and no
// bitmap (every chunk is there). It copies no hash, so that a chunk
// server may look for news every few milliseconds while a peer waits for
// them: ChunkState copies the whole hash list, 32 bytes a chunk.
// ErrNotFound when the store has none of d.
func (s *Store) ChunkMap(d digest.Digest, buf []byte) (have []byte, complete bool, err error) {
	if err := content.ValidateDigest(d); err != nil {
		return nil, false, err
	}
	if p := s.inFlight(d); p != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		return append(buf[:0], p.st.Have...), false, nil
	}
	if _, err := s.Stat(d); err != nil {
		return nil, false, err
	}
	return nil, true, nil
}
