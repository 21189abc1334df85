package p2p

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/hashicorp/memberlist"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

// testDigest returns a distinct, valid sha256 digest for each i.
func testDigest(i int) digest.Digest {
	return digest.FromBytes(fmt.Appendf(nil, "blob %d", i))
}

func TestEventRoundTrip(t *testing.T) {
	t.Parallel()
	for _, ev := range []holdingEvent{
		{Node: "a", holding: holding{Kind: EventComplete, Seq: 1, Digest: testDigest(1)}},
		{Node: "node-7.zone-b", holding: holding{Kind: EventPartial, Seq: math.MaxUint64, Digest: testDigest(2)}},
		{Node: strings.Repeat("n", maxNameLen), holding: holding{Kind: EventDropped, Seq: 0, Digest: testDigest(3)}},
		{Node: "ünïcode", holding: holding{Kind: EventComplete, Seq: 42, Digest: testDigest(4)}},
	} {
		b, err := encodeEvent(ev)
		require.NoError(t, err)
		require.LessOrEqual(t, len(b), maxEventSize)
		got, err := decodeEvent(b)
		require.NoError(t, err)
		assert.Equal(t, ev, got)
	}
	// The encoding is compact: 43 bytes and the name.
	b, err := encodeEvent(holdingEvent{Node: "abc", holding: holding{Kind: EventComplete, Seq: 1, Digest: testDigest(1)}})
	require.NoError(t, err)
	assert.Len(t, b, 1+1+3+holdingSize)
}

func TestEncodeEventRejects(t *testing.T) {
	t.Parallel()
	valid := holdingEvent{Node: "a", holding: holding{Kind: EventComplete, Seq: 1, Digest: testDigest(1)}}
	for name, mutate := range map[string]func(*holdingEvent){
		"empty name":     func(ev *holdingEvent) { ev.Node = "" },
		"long name":      func(ev *holdingEvent) { ev.Node = strings.Repeat("n", maxNameLen+1) },
		"non-UTF-8 name": func(ev *holdingEvent) { ev.Node = "\xff" },
		"zero kind":      func(ev *holdingEvent) { ev.Kind = 0 },
		"unknown kind":   func(ev *holdingEvent) { ev.Kind = EventDropped + 1 },
		"sha512 digest":  func(ev *holdingEvent) { ev.Digest = digest.SHA512.FromString("x") },
		"upper hex":      func(ev *holdingEvent) { ev.Digest = digest.Digest(strings.ToUpper(string(testDigest(1)))) },
		"empty digest":   func(ev *holdingEvent) { ev.Digest = "" },
	} {
		t.Run(name, func(t *testing.T) {
			ev := valid
			mutate(&ev)
			_, err := encodeEvent(ev)
			require.ErrorIs(t, err, content.ErrInvalid)
		})
	}
}

func TestDecodeEventRejects(t *testing.T) {
	t.Parallel()
	good, err := encodeEvent(holdingEvent{Node: "abc", holding: holding{Kind: EventPartial, Seq: 9, Digest: testDigest(1)}})
	require.NoError(t, err)
	with := func(i int, v byte) []byte {
		b := bytes.Clone(good)
		b[i] = v
		return b
	}
	for name, b := range map[string][]byte{
		"empty":          nil,
		"version 0":      with(0, 0),
		"version 2":      with(0, 2),
		"name length 0":  with(1, 0),
		"name too long":  with(1, 200),
		"non-UTF-8 name": with(2, 0xff),
		"kind 0":         with(5, 0),
		"kind 4":         with(5, 4),
		"truncated":      good[:len(good)-1],
		"header only":    good[:5],
		"trailing byte":  append(bytes.Clone(good), 0),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := decodeEvent(b)
			require.ErrorIs(t, err, errMalformed)
		})
	}
}

func TestStateRoundTripAndBound(t *testing.T) {
	t.Parallel()
	st := holdingState{Node: "node-1", Clock: 77}
	for i := range 3 {
		st.Holdings = append(st.Holdings, holding{Kind: EventKind(1 + i%2), Seq: uint64(10 - i), Digest: testDigest(i)})
	}
	b, err := encodeState(st, maxStateSize)
	require.NoError(t, err)
	got, err := decodeState(b)
	require.NoError(t, err)
	assert.Equal(t, st, got)

	// An empty state is valid.
	b, err = encodeState(holdingState{Node: "n"}, maxStateSize)
	require.NoError(t, err)
	got, err = decodeState(b)
	require.NoError(t, err)
	assert.Equal(t, holdingState{Node: "n", Holdings: []holding{}}, got)

	// Too many holdings: the first ones, in order, up to the limit, marked truncated.
	big := holdingState{Node: "n", Clock: 5000}
	for i := range 5000 {
		big.Holdings = append(big.Holdings, holding{Kind: EventComplete, Seq: uint64(5000 - i), Digest: testDigest(i)})
	}
	b, err = encodeState(big, maxStateSize)
	require.NoError(t, err)
	require.LessOrEqual(t, len(b), maxStateSize)
	require.Greater(t, len(b), maxStateSize-holdingSize)
	got, err = decodeState(b)
	require.NoError(t, err)
	assert.True(t, got.Truncated)
	assert.Equal(t, big.Holdings[:len(got.Holdings)], got.Holdings)

	// A smaller limit, and one too small for the header.
	b, err = encodeState(big, 200)
	require.NoError(t, err)
	assert.LessOrEqual(t, len(b), 200)
	_, err = encodeState(big, 11)
	require.ErrorIs(t, err, content.ErrInvalid)

	// Dropped holdings are not state.
	_, err = encodeState(holdingState{Node: "n", Holdings: []holding{{Kind: EventDropped, Digest: testDigest(1)}}}, maxStateSize)
	require.ErrorIs(t, err, content.ErrInvalid)
}

func TestDecodeStateRejects(t *testing.T) {
	t.Parallel()
	good, err := encodeState(holdingState{Node: "abc", Clock: 3, Holdings: []holding{
		{Kind: EventComplete, Seq: 1, Digest: testDigest(1)},
		{Kind: EventPartial, Seq: 2, Digest: testDigest(2)},
	}}, maxStateSize)
	require.NoError(t, err)
	header := 1 + 1 + 8 + 1 + 3
	with := func(i int, v byte) []byte {
		b := bytes.Clone(good)
		b[i] = v
		return b
	}
	oversized := append(bytes.Clone(good[:header]), make([]byte, (maxStateSize/holdingSize+1)*holdingSize)...)
	for name, b := range map[string][]byte{
		"empty":            nil,
		"version 2":        with(0, 2),
		"unknown flag":     with(1, 2),
		"short clock":      good[:5],
		"name length 0":    with(10, 0),
		"name past end":    with(10, 255),
		"partial holding":  good[:len(good)-1],
		"kind 0":           with(header, 0),
		"dropped in state": with(header, byte(EventDropped)),
		"over the limit":   oversized,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := decodeState(b)
			require.ErrorIs(t, err, errMalformed)
		})
	}
}

// maxOrigins and tooManyOrigins are counts of origin fetches at and past
// what node metadata carries.
var maxOrigins, tooManyOrigins = originCounts(maxMetaOrigins), originCounts(maxMetaOrigins + 1)

func originCounts(n int) map[OriginKey]int {
	counts := map[OriginKey]int{}
	for i := range n {
		counts[OriginKeyOf(fmt.Sprint("registry-", i))] = maxCountedFetches
	}
	return counts
}

func TestMetaRoundTrip(t *testing.T) {
	t.Parallel()
	for _, meta := range []NodeMeta{
		{},
		{ChunkAddr: "10.0.0.7:7947", Zone: "eu-west-1a", FreeDisk: 1 << 40, Version: "v1.2.3"},
		{ChunkAddr: "[fd00::1]:7947", FreeDisk: math.MaxInt64},
		{
			ChunkAddr:     strings.Repeat("h", maxChunkAddrLen-5) + ":7947",
			Zone:          strings.Repeat("z", maxZoneLen),
			FreeDisk:      math.MaxInt64,
			Version:       strings.Repeat("v", maxVersionLen),
			OriginFetches: maxOrigins,
		},
		{ChunkAddr: "10.0.0.7:7947", OriginFetches: map[OriginKey]int{OriginKeyOf("hf"): 3}},
	} {
		b, err := encodeMeta(meta)
		require.NoError(t, err)
		require.LessOrEqual(t, len(b), memberlist.MetaMaxSize)
		got, err := decodeMeta(b)
		require.NoError(t, err)
		assert.Equal(t, meta, got)
		// Nodes of the versions before per-origin counts send none, or
		// one count for all origins: it counts against every origin.
		counts := 1 + 5*len(meta.OriginFetches)
		sum := sumCounts(meta.OriginFetches)
		total := len(binary.AppendUvarint(nil, uint64(sum)))
		got, err = decodeMeta(b[:len(b)-counts])
		require.NoError(t, err)
		want := meta
		want.OriginFetches = nil
		if sum > 0 {
			want.OriginFetches = map[OriginKey]int{otherOrigins: min(sum, maxCountedFetches)}
		}
		assert.Equal(t, want, got, "the total alone")
		got, err = decodeMeta(b[:len(b)-counts-total])
		require.NoError(t, err)
		want.OriginFetches = nil
		assert.Equal(t, want, got, "no count")
		// A later minor version may append fields.
		got, err = decodeMeta(append(b, 1, 2, 3))
		require.NoError(t, err)
		assert.Equal(t, meta, got)
	}
}

func TestMetaRejects(t *testing.T) {
	t.Parallel()
	for name, meta := range map[string]NodeMeta{
		"chunk address without port": {ChunkAddr: "10.0.0.7"},
		"chunk address too long":     {ChunkAddr: strings.Repeat("h", maxChunkAddrLen) + ":1"},
		"zone too long":              {Zone: strings.Repeat("z", maxZoneLen+1)},
		"version too long":           {Version: strings.Repeat("v", maxVersionLen+1)},
		"non-UTF-8 zone":             {Zone: "\xff"},
		"negative free disk":         {FreeDisk: -1},
		"no origin fetches":          {OriginFetches: map[OriginKey]int{1: 0}},
		"too many origin fetches":    {OriginFetches: map[OriginKey]int{1: maxCountedFetches + 1}},
		"too many origins":           {OriginFetches: tooManyOrigins},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := encodeMeta(meta)
			require.ErrorIs(t, err, content.ErrInvalid)
		})
	}
	good, err := encodeMeta(NodeMeta{ChunkAddr: "a:1", Zone: "z", FreeDisk: 5, Version: "v"})
	require.NoError(t, err)
	bad := func(counts ...byte) []byte { return append(append([]byte{}, good[:len(good)-1]...), counts...) }
	overflow := []byte{metaVersion, 0, 0}
	overflow = binary.AppendUvarint(overflow, math.MaxInt64+1)
	overflow = append(overflow, 0)
	for name, b := range map[string][]byte{
		"empty":              nil,
		"version 2":          append([]byte{2}, good[1:]...),
		"truncated":          good[:len(good)-3],
		"string past end":    {metaVersion, 9, 'a'},
		"bad uvarint":        {metaVersion, 0, 0, 0x80},
		"free disk overflow": overflow,
		"too many origins":   bad(maxMetaOrigins + 1),
		"origins truncated":  bad(1, 0, 0, 0),
		"origin count 0":     bad(1, 0, 0, 0, 1, 0),
		"origin count 65":    bad(1, 0, 0, 0, 1, maxCountedFetches+1),
		"origins unordered":  bad(2, 0, 0, 0, 2, 1, 0, 0, 0, 1, 1),
		"origin twice":       bad(2, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1),
		"bad chunk address":  {metaVersion, 1, 'a', 0, 0, 0},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := decodeMeta(b)
			require.ErrorIs(t, err, errMalformed)
		})
	}
}

func TestEventKindString(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "complete", EventComplete.String())
	assert.Equal(t, "partial", EventPartial.String())
	assert.Equal(t, "dropped", EventDropped.String())
	assert.Equal(t, "invalid(0)", EventKind(0).String())
}

func FuzzDecodeMessage(f *testing.F) {
	for i, k := range []EventKind{EventComplete, EventPartial, EventDropped} {
		b, err := encodeEvent(holdingEvent{Node: fmt.Sprint("node-", i), holding: holding{Kind: k, Seq: uint64(i), Digest: testDigest(i)}})
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{eventVersion, 255})
	f.Fuzz(func(t *testing.T, b []byte) {
		ev, err := decodeEvent(b)
		if err != nil {
			require.ErrorIs(t, err, errMalformed)
			return
		}
		// Whatever decodes is canonical: it encodes back to the same bytes.
		out, err := encodeEvent(ev)
		require.NoError(t, err)
		require.Equal(t, b, out)
	})
}

func FuzzDecodeState(f *testing.F) {
	st := holdingState{Node: "seed", Clock: 9, Truncated: true}
	for i := range 3 {
		st.Holdings = append(st.Holdings, holding{Kind: EventComplete, Seq: uint64(i), Digest: testDigest(i)})
	}
	b, err := encodeState(st, maxStateSize)
	require.NoError(f, err)
	f.Add(b)
	f.Add([]byte{stateVersion, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 'n'})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := decodeState(b)
		if err != nil {
			require.ErrorIs(t, err, errMalformed)
			return
		}
		require.LessOrEqual(t, len(st.Holdings), maxStateSize/holdingSize)
		out, err := encodeState(st, maxStateSize)
		require.NoError(t, err)
		require.Equal(t, b, out)
	})
}

func FuzzDecodeMeta(f *testing.F) {
	for _, meta := range []NodeMeta{{}, {ChunkAddr: "10.0.0.1:7947", Zone: "a", FreeDisk: 1 << 33, Version: "dev"}, {OriginFetches: maxOrigins}} {
		b, err := encodeMeta(meta)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add(sha256.New().Sum(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		meta, err := decodeMeta(b)
		if err != nil {
			require.ErrorIs(t, err, errMalformed)
			return
		}
		out, err := encodeMeta(meta)
		require.NoError(t, err)
		require.LessOrEqual(t, len(out), memberlist.MetaMaxSize)
		again, err := decodeMeta(out)
		require.NoError(t, err)
		require.Equal(t, meta, again)
	})
}
