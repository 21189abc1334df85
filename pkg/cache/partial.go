package cache

import (
	"bytes"
	"crypto/sha256"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/opencontainers/go-digest"
)

const partialStateVersion = 1

// partialState is the persisted progress of a download: the bytes in
// [0, Verified) are durable in the data file, their chunk hashes are in
// Chunks, and HashState is the sha256 state after hashing exactly them.
type partialState struct {
	Version   int           `json:"version"`
	Digest    digest.Digest `json:"digest"`
	Size      int64         `json:"size"`
	ChunkSize int64         `json:"chunkSize"`
	Verified  int64         `json:"verified"`
	Chunks    []byte        `json:"chunks"`
	HashState []byte        `json:"hashState"`
}

func (s *Store) partialData(d digest.Digest) string {
	return filepath.Join(partialDir(s.root), d.Encoded()+".data")
}

func (s *Store) partialStatePath(d digest.Digest) string {
	return filepath.Join(partialDir(s.root), d.Encoded()+".state")
}

// loadPartials finds the partial downloads left on disk by an earlier run;
// they are resumed when their blob is asked for again and evictable until then.
func (s *Store) loadPartials() error {
	dir := partialDir(s.root)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("reading %s: %w", dir, err)
	}
	for _, e := range entries {
		name := e.Name()
		hex, isData := strings.CutSuffix(name, ".data")
		if !isData {
			hex, _ = strings.CutSuffix(name, ".state")
		}
		d := digest.NewDigestFromEncoded(digest.SHA256, hex)
		if ValidateDigest(d) != nil || (!isData && !strings.HasSuffix(name, ".state")) {
			os.Remove(filepath.Join(dir, name)) // temp files of an interrupted state write
			continue
		}
		if !isData {
			if _, err := os.Stat(s.partialData(d)); errors.Is(err, os.ErrNotExist) {
				os.Remove(filepath.Join(dir, name))
			}
			continue
		}
		if _, complete := s.blobs[d]; complete {
			s.removePartial(d)
			continue
		}
		if info, err := e.Info(); err == nil {
			s.partials[d] = info.Size()
		}
	}
	return nil
}

// readState returns the saved progress of d if it is usable for desc with the
// store's chunk size, and nil otherwise.
func (s *Store) readState(desc Descriptor) *partialState {
	b, err := os.ReadFile(s.partialStatePath(desc.Digest))
	if err != nil {
		return nil
	}
	var st partialState
	if err := json.Unmarshal(b, &st); err != nil {
		s.log.Warn("discarding unreadable partial state", "digest", desc.Digest, "err", err)
		return nil
	}
	nChunks := (st.Verified + st.ChunkSize - 1) / max(st.ChunkSize, 1)
	switch {
	case st.Version != partialStateVersion, st.Digest != desc.Digest, st.Size != desc.Size,
		st.ChunkSize != s.opts.chunkSize, st.Verified < 0, st.Verified > st.Size,
		st.Verified%st.ChunkSize != 0 && st.Verified != st.Size,
		int64(len(st.Chunks)) != nChunks*sha256.Size:
		s.log.Info("partial state does not match; starting over", "digest", desc.Digest)
		return nil
	}
	return &st
}

// verifyResume re-reads the durable prefix of a partial download and checks
// every chunk against its recorded hash, so a resumed download continues only
// from bytes that are really on disk. It returns the whole-blob hash restored
// at the end of the prefix.
func verifyResume(f *os.File, st *partialState) (hashState, error) {
	h := sha256.New()
	if err := h.(encoding.BinaryUnmarshaler).UnmarshalBinary(st.HashState); err != nil {
		return nil, fmt.Errorf("restoring hash state: %w", err)
	}
	chunks, err := hashChunks(f, st.Verified, st.ChunkSize)
	if err != nil {
		return nil, fmt.Errorf("reading the verified prefix: %w", err)
	}
	if !bytes.Equal(chunks, st.Chunks) {
		return nil, errors.New("chunks on disk do not match their recorded hashes")
	}
	return h.(hashState), nil
}

// saveState persists st atomically: temp file, fsync, rename, fsync dir.
func (s *Store) saveState(st *partialState) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return writeFileAtomic(s.partialStatePath(st.Digest), b, 0o600)
}

func (s *Store) removePartial(d digest.Digest) {
	os.Remove(s.partialStatePath(d))
	os.Remove(s.partialData(d))
}
