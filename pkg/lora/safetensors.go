package lora

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"sort"
)

// MaxHeaderBytes bounds the JSON header of a safetensors file. The format
// allows 100 MB; an adapter's header is a few hundred bytes per tensor.
const MaxHeaderBytes = 16 << 20

// maxDims bounds the rank of a tensor's shape.
const maxDims = 8

// Tensor is one entry of a safetensors header. Offsets are relative to the
// start of the data, after the header.
type Tensor struct {
	Name  string
	DType string
	Shape []int64
	Begin int64
	End   int64
}

// dtypeSize is the size in bytes of each element type safetensors defines.
var dtypeSize = map[string]int64{
	"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
	"I16": 2, "U16": 2, "F16": 2, "BF16": 2,
	"I32": 4, "U32": 4, "F32": 4,
	"I64": 8, "U64": 8, "F64": 8,
}

// ReadSafetensors reads and checks the header of the safetensors file r of
// size bytes: an 8-byte little-endian header length, then the JSON header.
// The tensors it returns are sorted by offset.
func ReadSafetensors(r io.ReaderAt, size int64) ([]Tensor, error) {
	var lenBuf [8]byte
	if size < 8 {
		return nil, fmt.Errorf("%d bytes, shorter than the 8-byte header length: %w", size, ErrInvalid)
	}
	if _, err := r.ReadAt(lenBuf[:], 0); err != nil {
		return nil, fmt.Errorf("reading the header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > MaxHeaderBytes {
		return nil, fmt.Errorf("header length %d over %d: %w", n, MaxHeaderBytes, ErrInvalid)
	}
	if int64(n) > size-8 {
		return nil, fmt.Errorf("header length %d past the end of the file (%d bytes): %w", n, size, ErrInvalid)
	}
	header := make([]byte, n)
	if _, err := r.ReadAt(header, 8); err != nil {
		return nil, fmt.Errorf("reading the header: %w", err)
	}
	return ParseSafetensorsHeader(header, size-8-int64(n))
}

type rawTensor struct {
	DType       string   `json:"dtype"`
	Shape       []int64  `json:"shape"`
	DataOffsets *[]int64 `json:"data_offsets"`
}

// ParseSafetensorsHeader parses the JSON header of a safetensors file whose
// data after the header is dataSize bytes, and checks every tensor: a known
// dtype, a shape whose size matches its offsets, offsets within the data,
// and tensors that cover the data without holes or overlaps.
func ParseSafetensorsHeader(header []byte, dataSize int64) ([]Tensor, error) {
	if len(header) > MaxHeaderBytes {
		return nil, fmt.Errorf("header of %d bytes over %d: %w", len(header), MaxHeaderBytes, ErrInvalid)
	}
	if dataSize < 0 {
		return nil, fmt.Errorf("negative data size %d: %w", dataSize, ErrInvalid)
	}
	trimmed := bytes.TrimLeft(header, " \t\r\n")
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, fmt.Errorf("header is not a JSON object: %w", ErrInvalid)
	}
	var entries map[string]json.RawMessage
	if err := json.Unmarshal(header, &entries); err != nil {
		return nil, fmt.Errorf("parsing the header: %v: %w", err, ErrInvalid)
	}
	tensors := make([]Tensor, 0, len(entries))
	for name, raw := range entries {
		if name == "__metadata__" {
			var meta map[string]string
			if err := json.Unmarshal(raw, &meta); err != nil {
				return nil, fmt.Errorf("__metadata__ is not a map of strings: %w", ErrInvalid)
			}
			continue
		}
		t, err := parseTensor(name, raw, dataSize)
		if err != nil {
			return nil, err
		}
		tensors = append(tensors, t)
	}
	sort.Slice(tensors, func(i, j int) bool {
		if tensors[i].Begin != tensors[j].Begin {
			return tensors[i].Begin < tensors[j].Begin
		}
		return tensors[i].Name < tensors[j].Name
	})
	var next int64
	for _, t := range tensors {
		if t.Begin < next {
			return nil, fmt.Errorf("tensor %s: data_offsets [%d,%d) overlap the previous tensor: %w", t.Name, t.Begin, t.End, ErrInvalid)
		}
		if t.Begin > next {
			return nil, fmt.Errorf("tensor %s: data_offsets [%d,%d) leave a hole at %d: %w", t.Name, t.Begin, t.End, next, ErrInvalid)
		}
		next = t.End
	}
	if next != dataSize {
		return nil, fmt.Errorf("tensors cover %d of the %d data bytes: %w", next, dataSize, ErrInvalid)
	}
	return tensors, nil
}

var errOverflow = errors.New("overflow")

func parseTensor(name string, raw json.RawMessage, dataSize int64) (Tensor, error) {
	var rt rawTensor
	if err := json.Unmarshal(raw, &rt); err != nil {
		return Tensor{}, fmt.Errorf("tensor %s: %v: %w", name, err, ErrInvalid)
	}
	t := Tensor{Name: name, DType: rt.DType, Shape: rt.Shape}
	elem, ok := dtypeSize[rt.DType]
	if !ok {
		return Tensor{}, fmt.Errorf("tensor %s: unknown dtype %q: %w", name, rt.DType, ErrInvalid)
	}
	if rt.Shape == nil {
		return Tensor{}, fmt.Errorf("tensor %s: shape missing: %w", name, ErrInvalid)
	}
	if len(rt.Shape) > maxDims {
		return Tensor{}, fmt.Errorf("tensor %s: %d dimensions, over %d: %w", name, len(rt.Shape), maxDims, ErrInvalid)
	}
	if rt.DataOffsets == nil || len(*rt.DataOffsets) != 2 {
		return Tensor{}, fmt.Errorf("tensor %s: data_offsets is not a pair: %w", name, ErrInvalid)
	}
	t.Begin, t.End = (*rt.DataOffsets)[0], (*rt.DataOffsets)[1]
	if t.Begin < 0 || t.End < t.Begin {
		return Tensor{}, fmt.Errorf("tensor %s: data_offsets [%d,%d) out of order: %w", name, t.Begin, t.End, ErrInvalid)
	}
	if t.End > dataSize {
		return Tensor{}, fmt.Errorf("tensor %s: data_offsets [%d,%d) past the end of the file (%d data bytes): %w", name, t.Begin, t.End, dataSize, ErrInvalid)
	}
	want, err := byteSize(rt.Shape, elem)
	if err != nil {
		return Tensor{}, fmt.Errorf("tensor %s: shape %v: %v: %w", name, rt.Shape, err, ErrInvalid)
	}
	if got := t.End - t.Begin; uint64(got) != want {
		return Tensor{}, fmt.Errorf("tensor %s: %s %v is %d bytes, data_offsets [%d,%d) hold %d: %w", name, rt.DType, rt.Shape, want, t.Begin, t.End, got, ErrInvalid)
	}
	return t, nil
}

// byteSize is product(shape) * elem, without overflow.
func byteSize(shape []int64, elem int64) (uint64, error) {
	n := uint64(elem)
	for _, d := range shape {
		if d < 0 {
			return 0, errors.New("negative dimension")
		}
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > 1<<62 {
			return 0, errOverflow
		}
		n = lo
	}
	return n, nil
}
