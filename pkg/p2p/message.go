package p2p

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"slices"
	"unicode/utf8"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// The wire formats of everything weightd puts on gossip. All of it comes from
// the network, so every decoder checks every length against the bytes it was
// handed before it slices or allocates, and rejects what it does not
// understand with an error wrapping errMalformed; none of them panics.
//
// Integers are big-endian unless they are uvarints. A name is one length
// byte (1 to 255) and that many bytes of UTF-8. A holding is 41 bytes:
//
//	kind    1 byte   EventComplete, EventPartial or EventDropped
//	seq     8 bytes  the announcing node's clock for this change
//	digest 32 bytes  the blob's sha256, raw
//
// Event (one holding change, a memberlist user message, relayed by every node
// that learns something new from it):
//
//	version 1 byte   eventVersion
//	node    name     the node whose holding changed
//	holding 41 bytes
//
// State (a node's own holdings, exchanged in memberlist push/pull, at most
// maxStateSize bytes, newest first):
//
//	version 1 byte   stateVersion
//	flags   1 byte   stateTruncated when holdings were left out to fit
//	clock   8 bytes  the node's clock when it took the snapshot
//	node    name
//	holdings, 41 bytes each, to the end; never EventDropped
//
// Node metadata (memberlist's node meta, at most memberlist.MetaMaxSize
// bytes):
//
//	version   1 byte  metaVersion
//	chunkAddr 1 length byte + up to maxChunkAddrLen bytes, "" or host:port
//	zone      1 length byte + up to maxZoneLen bytes
//	freeDisk  uvarint, at most math.MaxInt64
//	version   1 length byte + up to maxVersionLen bytes
//	fetches   uvarint, the sum of the counts below (an older agent's one
//	          count for all origins)
//	origins   1 byte n, at most maxMetaOrigins; then n times a 4-byte
//	          OriginKey and 1 byte, its count (1 to maxCountedFetches),
//	          the keys ascending
//
// Bytes after the known fields of node metadata are ignored, so a later
// minor version can append fields without cutting older agents off from its
// chunk server; a different version byte is rejected.

const (
	eventVersion byte = 1
	stateVersion byte = 1
	metaVersion  byte = 1

	stateTruncated byte = 1 << 0

	holdingSize = 1 + 8 + sha256Size
	sha256Size  = 32

	maxNameLen      = 255
	maxChunkAddrLen = 255
	maxZoneLen      = 63
	maxVersionLen   = 128
	// maxMetaOrigins bounds the origins NodeMeta.OriginFetches counts,
	// so that a node's metadata fits memberlist's 512 bytes.
	maxMetaOrigins = 8

	// maxStateSize bounds the push/pull state: about 1,500 holdings.
	maxStateSize = 64 << 10
	// maxEventSize is the largest event: version, name, holding.
	maxEventSize = 1 + 1 + maxNameLen + holdingSize
)

// errMalformed is wrapped by every decoding error.
var errMalformed = errors.New("malformed gossip data")

// EventKind is what a node announces about a blob it holds.
type EventKind uint8

// The kinds of holding change. The zero EventKind is invalid.
const (
	// EventComplete: the node holds the whole, verified blob.
	EventComplete EventKind = iota + 1
	// EventPartial: the node is downloading the blob and serves the
	// verified chunks it has so far.
	EventPartial
	// EventDropped: the node no longer holds any of the blob.
	EventDropped
)

// String returns "complete", "partial", "dropped" or "invalid(N)".
func (k EventKind) String() string {
	switch k {
	case EventComplete:
		return "complete"
	case EventPartial:
		return "partial"
	case EventDropped:
		return "dropped"
	}
	return fmt.Sprintf("invalid(%d)", uint8(k))
}

func (k EventKind) valid() bool { return k >= EventComplete && k <= EventDropped }

// holding is one node's claim about one blob at one point of its clock.
type holding struct {
	Kind   EventKind
	Seq    uint64
	Digest digest.Digest
}

// holdingEvent is a holding change of the node Node.
type holdingEvent struct {
	Node string
	holding
}

// holdingState is the snapshot of Node's own holdings sent in push/pull.
type holdingState struct {
	Node      string
	Clock     uint64
	Truncated bool
	Holdings  []holding
}

func appendName(b []byte, name string) ([]byte, error) {
	if err := validateName(name); err != nil {
		return nil, err
	}
	b = append(b, byte(len(name)))
	return append(b, name...), nil
}

func validateName(name string) error {
	if name == "" || len(name) > maxNameLen || !utf8.ValidString(name) {
		return fmt.Errorf("%w: node name %q: want 1 to %d bytes of UTF-8", content.ErrInvalid, name, maxNameLen)
	}
	return nil
}

func appendHolding(b []byte, h holding) ([]byte, error) {
	if !h.Kind.valid() {
		return nil, fmt.Errorf("%w: event kind %v", content.ErrInvalid, h.Kind)
	}
	if err := content.ValidateDigest(h.Digest); err != nil {
		return nil, err
	}
	b = append(b, byte(h.Kind))
	b = binary.BigEndian.AppendUint64(b, h.Seq)
	return hex.AppendDecode(b, []byte(h.Digest.Encoded()))
}

// encodeEvent encodes one holding change; it fails only on an invalid kind,
// digest or node name.
func encodeEvent(ev holdingEvent) ([]byte, error) {
	b := make([]byte, 0, maxEventSize)
	b = append(b, eventVersion)
	b, err := appendName(b, ev.Node)
	if err != nil {
		return nil, err
	}
	return appendHolding(b, ev.holding)
}

// decodeEvent decodes an event. The result shares no memory with b.
func decodeEvent(b []byte) (holdingEvent, error) {
	var ev holdingEvent
	r := wireReader{b: b}
	if v := r.byte(); v != eventVersion {
		r.fail(fmt.Errorf("event version %d", v))
		return ev, r.err
	}
	ev.Node = r.name()
	ev.holding = r.holding()
	if r.err == nil && len(r.b) != 0 {
		return ev, fmt.Errorf("%w: %d bytes after the event", errMalformed, len(r.b))
	}
	return ev, r.err
}

// encodeState encodes st with as many of its holdings, in the order given,
// as fit in maxSize bytes (at most maxStateSize), setting Truncated when some
// are left out. It fails on an invalid name or holding, or when maxSize
// cannot hold even the header.
func encodeState(st holdingState, maxSize int) ([]byte, error) {
	if err := validateName(st.Node); err != nil {
		return nil, err
	}
	header := 1 + 1 + 8 + 1 + len(st.Node)
	maxSize = min(maxSize, maxStateSize)
	if maxSize < header {
		return nil, fmt.Errorf("%w: state size limit %d under its header's %d bytes", content.ErrInvalid, maxSize, header)
	}
	fit := min(len(st.Holdings), (maxSize-header)/holdingSize)
	b := make([]byte, 0, header+fit*holdingSize)
	flags := byte(0)
	if st.Truncated || fit < len(st.Holdings) {
		flags |= stateTruncated
	}
	b = append(b, stateVersion, flags)
	b = binary.BigEndian.AppendUint64(b, st.Clock)
	b, err := appendName(b, st.Node)
	if err != nil {
		return nil, err
	}
	for _, h := range st.Holdings[:fit] {
		if h.Kind == EventDropped {
			return nil, fmt.Errorf("%w: dropped holding %v in a state", content.ErrInvalid, h.Digest)
		}
		if b, err = appendHolding(b, h); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// decodeState decodes a push/pull state. The result shares no memory with b.
func decodeState(b []byte) (holdingState, error) {
	var st holdingState
	if len(b) > maxStateSize {
		return st, fmt.Errorf("%w: state of %d bytes, limit %d", errMalformed, len(b), maxStateSize)
	}
	r := wireReader{b: b}
	if v := r.byte(); v != stateVersion {
		r.fail(fmt.Errorf("state version %d", v))
		return st, r.err
	}
	flags := r.byte()
	if flags&^stateTruncated != 0 {
		r.fail(fmt.Errorf("state flags %#x", flags))
		return st, r.err
	}
	st.Truncated = flags&stateTruncated != 0
	st.Clock = r.uint64()
	st.Node = r.name()
	if r.err != nil {
		return st, r.err
	}
	if len(r.b)%holdingSize != 0 {
		return st, fmt.Errorf("%w: %d bytes of holdings, not a multiple of %d", errMalformed, len(r.b), holdingSize)
	}
	st.Holdings = make([]holding, 0, len(r.b)/holdingSize) // bounded by maxStateSize above
	for len(r.b) > 0 {
		h := r.holding()
		if r.err == nil && h.Kind == EventDropped {
			return st, fmt.Errorf("%w: dropped holding in a state", errMalformed)
		}
		st.Holdings = append(st.Holdings, h)
	}
	return st, r.err
}

// validateMeta checks that meta can be encoded: short fields, a host:port
// chunk address or none, free disk not negative.
func validateMeta(meta NodeMeta) error {
	if err := validateMetaString("chunk address", meta.ChunkAddr, maxChunkAddrLen); err != nil {
		return err
	}
	if meta.ChunkAddr != "" {
		if _, _, err := net.SplitHostPort(meta.ChunkAddr); err != nil {
			return fmt.Errorf("%w: chunk address %q: %v", content.ErrInvalid, meta.ChunkAddr, err)
		}
	}
	if err := validateMetaString("zone", meta.Zone, maxZoneLen); err != nil {
		return err
	}
	if err := validateMetaString("version", meta.Version, maxVersionLen); err != nil {
		return err
	}
	if meta.FreeDisk < 0 {
		return fmt.Errorf("%w: free disk %d is negative", content.ErrInvalid, meta.FreeDisk)
	}
	if len(meta.OriginFetches) > maxMetaOrigins {
		return fmt.Errorf("%w: origin fetches of %d origins: want at most %d", content.ErrInvalid, len(meta.OriginFetches), maxMetaOrigins)
	}
	for key, n := range meta.OriginFetches {
		if n < 1 || n > maxCountedFetches {
			return fmt.Errorf("%w: origin fetches %d from origin %08x: want 1 to %d", content.ErrInvalid, n, key, maxCountedFetches)
		}
	}
	return nil
}

func validateMetaString(what, s string, limit int) error {
	if len(s) > limit || !utf8.ValidString(s) {
		return fmt.Errorf("%w: %s %q: want at most %d bytes of UTF-8", content.ErrInvalid, what, s, limit)
	}
	return nil
}

// encodeMeta encodes node metadata; the result is at most 503 bytes, under
// memberlist's limit of 512. The origin fetches come last: a node of an
// older version ignores them, and they read as none from one.
func encodeMeta(meta NodeMeta) ([]byte, error) {
	if err := validateMeta(meta); err != nil {
		return nil, err
	}
	b := make([]byte, 0, 7+len(meta.ChunkAddr)+len(meta.Zone)+len(meta.Version)+binary.MaxVarintLen64+5*len(meta.OriginFetches))
	b = append(b, metaVersion, byte(len(meta.ChunkAddr)))
	b = append(b, meta.ChunkAddr...)
	b = append(b, byte(len(meta.Zone)))
	b = append(b, meta.Zone...)
	b = binary.AppendUvarint(b, uint64(meta.FreeDisk))
	b = append(b, byte(len(meta.Version)))
	b = append(b, meta.Version...)
	keys := slices.Sorted(maps.Keys(meta.OriginFetches))
	b = binary.AppendUvarint(b, uint64(sumCounts(meta.OriginFetches)))
	b = append(b, byte(len(keys)))
	for _, key := range keys {
		b = binary.BigEndian.AppendUint32(b, uint32(key))
		b = append(b, byte(meta.OriginFetches[key]))
	}
	return b, nil
}

// sumCounts is the sum of counts' values.
func sumCounts(counts map[OriginKey]int) int {
	sum := 0
	for _, n := range counts {
		sum += n
	}
	return sum
}

// decodeMeta decodes node metadata and validates it as encodeMeta would. The
// result shares no memory with b.
func decodeMeta(b []byte) (NodeMeta, error) {
	var meta NodeMeta
	r := wireReader{b: b}
	if v := r.byte(); v != metaVersion {
		r.fail(fmt.Errorf("meta version %d", v))
		return meta, r.err
	}
	meta.ChunkAddr = r.string()
	meta.Zone = r.string()
	free := r.uvarint()
	if r.err == nil && free > math.MaxInt64 {
		return meta, fmt.Errorf("%w: free disk %d", errMalformed, free)
	}
	meta.FreeDisk = int64(free)
	meta.Version = r.string()
	var total uint64 // for agents that know no origins
	if r.err == nil && len(r.b) > 0 {
		total = r.uvarint()
	}
	if r.err == nil && len(r.b) > 0 {
		meta.OriginFetches = r.originFetches()
	} else if r.err == nil && total > 0 {
		// Such an agent's fetches may be of any origin.
		meta.OriginFetches = map[OriginKey]int{otherOrigins: int(min(total, maxCountedFetches))}
	}
	if r.err != nil {
		return NodeMeta{}, r.err
	}
	if err := validateMeta(meta); err != nil {
		return NodeMeta{}, fmt.Errorf("%w: %v", errMalformed, err)
	}
	return meta, nil
}

// originFetches reads node metadata's counts of origin fetches.
func (r *wireReader) originFetches() map[OriginKey]int {
	n := int(r.byte())
	if n > maxMetaOrigins {
		r.fail(fmt.Errorf("origin fetches of %d origins", n))
		return nil
	}
	if n == 0 {
		return nil
	}
	counts := make(map[OriginKey]int, n)
	last := -1
	for range n {
		key, count := r.take(4), r.byte()
		if r.err != nil {
			return nil
		}
		if k := int(binary.BigEndian.Uint32(key)); k > last {
			last = k
		} else {
			r.fail(fmt.Errorf("origin %08x out of order", k))
			return nil
		}
		counts[OriginKey(last)] = int(count)
	}
	return counts
}

// wireReader consumes b from the front. After the first error every read
// returns a zero value and err keeps that first error.
type wireReader struct {
	b   []byte
	err error
}

func (r *wireReader) fail(err error) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %v", errMalformed, err)
	}
	r.b = nil
}

func (r *wireReader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.b) {
		r.fail(fmt.Errorf("need %d bytes, have %d", n, len(r.b)))
		return nil
	}
	p := r.b[:n]
	r.b = r.b[n:]
	return p
}

func (r *wireReader) byte() byte {
	if p := r.take(1); p != nil {
		return p[0]
	}
	return 0
}

func (r *wireReader) uint64() uint64 {
	if p := r.take(8); p != nil {
		return binary.BigEndian.Uint64(p)
	}
	return 0
}

func (r *wireReader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail(errors.New("bad uvarint"))
		return 0
	}
	r.b = r.b[n:]
	return v
}

// string reads a length byte and that many bytes.
func (r *wireReader) string() string {
	n := r.byte()
	return string(r.take(int(n)))
}

func (r *wireReader) name() string {
	s := r.string()
	if r.err == nil {
		if err := validateName(s); err != nil {
			r.fail(err)
		}
	}
	return s
}

func (r *wireReader) holding() holding {
	var h holding
	h.Kind = EventKind(r.byte())
	h.Seq = r.uint64()
	raw := r.take(sha256Size)
	if r.err != nil {
		return holding{}
	}
	if !h.Kind.valid() {
		r.fail(fmt.Errorf("event kind %d", uint8(h.Kind)))
		return holding{}
	}
	h.Digest = digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(raw))
	return h
}
