package p2p

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/weightd/weightd/pkg/cache"
)

// PeerState is what a chunk server says about one blob: the chunks it has
// verified and their hashes, whether it fetches the blob from the origin,
// which chunks are on their way to it (it relays them as they come), and
// which chunks it has already sent to some peer, so that requesters spread its upload over
// different chunks and pass them on to each other. A requester that
// already holds the hashes of some chunks says so, and the state leaves
// them out (Known): a state is re-read at each news, and its hashes were
// most of its bytes, 1.3% of a blob's size uploaded to each of 7
// followers of a 512 MiB download.
type PeerState struct {
	cache.ChunkState
	Origin   bool
	Sent     []byte // bitmap like Have; nil when the server sent nothing yet
	Fetching []byte // bitmap like Have, of chunks it has not: those on their way to it; nil when none, or not asked for
	Known    []byte // bitmap like Have, a subset of it: chunks whose hashes are left out, the requester has them; nil when none
}

// WasSent reports whether the server has already sent chunk i to a peer.
func (p PeerState) WasSent(i int) bool { return bitSet(p.Sent, i) }

// IsFetching reports whether chunk i is on its way to the server.
func (p PeerState) IsFetching(i int) bool { return bitSet(p.Fetching, i) }

// bitSet reports whether bit i of bitmap b (LSB-first) is set.
func bitSet(b []byte, i int) bool {
	return i >= 0 && i/8 < len(b) && b[i/8]&(1<<(i%8)) != 0
}

// setBit sets or clears bit i of bitmap b, growing it as needed.
func setBit(b []byte, i int, on bool) []byte {
	if len(b) <= i/8 {
		b = append(b, make([]byte, i/8+1-len(b))...)
	}
	if on {
		b[i/8] |= 1 << (i % 8)
	} else {
		b[i/8] &^= 1 << (i % 8)
	}
	return b
}

// intersect returns the bits of b that have has too, shaped like have.
func intersect(b, have []byte) []byte {
	out := make([]byte, len(have))
	for i := range min(len(b), len(have)) {
		out[i] = b[i] & have[i]
	}
	return out
}

// fillKnown fills in the hashes p left out (Known) from last, an earlier
// state of the same server, which must have them.
func (p *PeerState) fillKnown(last PeerState) error {
	for i := range chunksOf(p.Size, p.ChunkSize) {
		if !bitSet(p.Known, i) {
			continue
		}
		h := last.Hash(i)
		if h == nil {
			return fmt.Errorf("chunk state: the hash of chunk %d left out, and not known", i)
		}
		copy(p.Hashes[i*32:], h)
	}
	p.Known = nil
	return nil
}

// notHeld returns the bits of b that have lacks, shaped like have, or nil
// when there are none.
func notHeld(b, have []byte) []byte {
	var out []byte
	for i := range min(len(b), len(have)) {
		if x := b[i] &^ have[i]; x != 0 {
			if out == nil {
				out = make([]byte, len(have))
			}
			out[i] = x
		}
	}
	return out
}

// Chunk state wire format, all integers big-endian:
//
//	magic "WDCS" | version 1 | flags | size uint64 | chunk size uint64 |
//	have bitmap (ceil(chunks/8) bytes, bit i LSB-first = chunk i) |
//	[sent bitmap, same length, a subset of have, when flag 4] |
//	[fetching bitmap, same length, disjoint from have, when flag 8] |
//	[known bitmap, same length, a subset of have, when flag 16] |
//	sha256 of each present chunk not known, in order
//
// flags: 1 complete, 2 fetching from the origin, 4 sent bitmap present,
// 8 fetching bitmap present, 16 known bitmap present.
const (
	chunkStateMagic      = "WDCS"
	chunkStateVersion    = 1
	chunkStateHeaderSize = 4 + 1 + 1 + 8 + 8
	flagComplete         = 1
	flagOrigin           = 2
	flagSent             = 4
	flagFetching         = 8
	flagKnown            = 16
	// Bounds on what a peer may claim: a blob of at most 16 TiB, chunks of
	// 64 KiB to 1 GiB, at most 16 Mi chunks.
	maxChunkStateSize      = 16 << 40
	minChunkStateChunkSize = 64 << 10
	maxChunkStateChunkSize = 1 << 30
	maxChunkStateChunks    = 16 << 20
	// maxChunkStateBytes bounds a whole encoded state.
	maxChunkStateBytes = chunkStateHeaderSize + 4*maxChunkStateChunks/8 + maxChunkStateChunks*32
)

// maxPeerStateBytes is the most an encoded state of a blob of n chunks
// takes: its header, four bitmaps and a hash per chunk.
func maxPeerStateBytes(n int) int64 {
	n = min(max(n, 0), maxChunkStateChunks)
	return chunkStateHeaderSize + 4*int64((n+7)/8) + 32*int64(n)
}

// EncodePeerState encodes p for the wire.
func EncodePeerState(p PeerState) []byte {
	n := chunksOf(p.Size, p.ChunkSize)
	b := make([]byte, 0, chunkStateHeaderSize+4*len(p.Have)+n*32)
	b = append(b, chunkStateMagic...)
	var flags byte
	if p.Complete {
		flags |= flagComplete
	}
	if p.Origin {
		flags |= flagOrigin
	}
	if p.Sent != nil {
		flags |= flagSent
	}
	if p.Fetching != nil {
		flags |= flagFetching
	}
	if p.Known != nil {
		flags |= flagKnown
	}
	b = append(b, chunkStateVersion, flags)
	b = binary.BigEndian.AppendUint64(b, uint64(p.Size))
	b = binary.BigEndian.AppendUint64(b, uint64(p.ChunkSize))
	b = append(b, p.Have...)
	if p.Sent != nil {
		b = append(b, p.Sent...)
	}
	if p.Fetching != nil {
		b = append(b, p.Fetching...)
	}
	if p.Known != nil {
		b = append(b, p.Known...)
	}
	for i := range n {
		if p.Has(i) && !bitSet(p.Known, i) {
			b = append(b, p.Hash(i)...)
		}
	}
	return b
}

// DecodePeerState decodes a peer's state of a blob, rejecting anything
// malformed or out of bounds; it never trusts a length it has not checked.
func DecodePeerState(b []byte) (PeerState, error) {
	var p PeerState
	if len(b) < chunkStateHeaderSize || string(b[:4]) != chunkStateMagic {
		return p, errors.New("chunk state: bad header")
	}
	if b[4] != chunkStateVersion {
		return p, fmt.Errorf("chunk state: unknown version %d", b[4])
	}
	flags := b[5]
	if flags&^(flagComplete|flagOrigin|flagSent|flagFetching|flagKnown) != 0 {
		return p, fmt.Errorf("chunk state: unknown flags %#x", flags)
	}
	size, cs := binary.BigEndian.Uint64(b[6:]), binary.BigEndian.Uint64(b[14:])
	if size > maxChunkStateSize || cs < minChunkStateChunkSize || cs > maxChunkStateChunkSize {
		return p, fmt.Errorf("chunk state: size %d, chunk size %d out of bounds", size, cs)
	}
	n := chunksOf(int64(size), int64(cs))
	if n > maxChunkStateChunks {
		return p, fmt.Errorf("chunk state: %d chunks", n)
	}
	bitmap := (n + 7) / 8
	rest := b[chunkStateHeaderSize:]
	take := func() ([]byte, error) {
		if len(rest) < bitmap {
			return nil, errors.New("chunk state: short bitmap")
		}
		m := append([]byte{}, rest[:bitmap]...)
		rest = rest[bitmap:]
		if n%8 != 0 && m[bitmap-1]>>(n%8) != 0 {
			return nil, errors.New("chunk state: bits set past the last chunk")
		}
		return m, nil
	}
	have, err := take()
	if err != nil {
		return PeerState{}, err
	}
	p = PeerState{ChunkState: cache.ChunkState{Size: int64(size), ChunkSize: int64(cs), Complete: flags&flagComplete != 0, Have: have},
		Origin: flags&flagOrigin != 0}
	if flags&flagSent != 0 {
		if p.Sent, err = take(); err != nil {
			return PeerState{}, err
		}
		if notHeld(p.Sent, have) != nil {
			return PeerState{}, errors.New("chunk state: sent a chunk it does not have")
		}
	}
	if flags&flagFetching != 0 {
		if p.Fetching, err = take(); err != nil {
			return PeerState{}, err
		}
		if countBits(intersect(p.Fetching, have)) != 0 {
			return PeerState{}, errors.New("chunk state: fetching a chunk it has")
		}
	}
	if flags&flagKnown != 0 {
		if p.Known, err = take(); err != nil {
			return PeerState{}, err
		}
		if notHeld(p.Known, have) != nil {
			return PeerState{}, errors.New("chunk state: knows the hash of a chunk it does not have")
		}
	}
	if p.Complete && countBits(have) != n {
		return PeerState{}, errors.New("chunk state: complete but chunks missing")
	}
	hashed := countBits(have) - countBits(p.Known)
	if len(rest) != hashed*32 {
		return PeerState{}, fmt.Errorf("chunk state: %d bytes of hashes for %d chunks", len(rest), hashed)
	}
	p.Hashes = make([]byte, n*32)
	for i := range n {
		if p.Has(i) && !bitSet(p.Known, i) {
			copy(p.Hashes[i*32:], rest[:32])
			rest = rest[32:]
		}
	}
	return p, nil
}
