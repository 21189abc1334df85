package containerd

import (
	"fmt"
	"math/bits"
	"sync"

	containerd "github.com/containerd/containerd/v2/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the codec Unmarshal uses
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// writeChunk is the data in each content write message: 4 MiB less room
// for the message's other fields, so that it is marshalled into a 4 MiB
// buffer of reusePool. Each message is a round trip to containerd; on 2
// busy cores, 1 MiB messages cost this process about 10% more CPU than 4 MiB
// ones and containerd the same (BenchmarkContentWrite, bench/image). The
// client cuts messages at 8 MiB, containerd 1.6 refuses more than 16 MiB.
const writeChunk = 4<<20 - 1<<10

// dialOpts are the options of the importer's containerd client: messages
// are marshalled into buffers of reusePool. grpc's proto codec takes them
// from its default pool, which clears every buffer it hands out and
// allocates those over 1 MiB afresh: clearing was a third of the
// importer's CPU per byte written (BenchmarkContentWrite).
func dialOpts() []containerd.Opt {
	return []containerd.Opt{containerd.WithExtraDialOpts([]grpc.DialOption{
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(poolCodec{})),
	})}
}

// poolCodec is grpc's proto codec, marshalling into reusePool's buffers.
type poolCodec struct{}

func (poolCodec) Name() string { return "proto" }

func (poolCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("proto: cannot marshal %T", v)
	}
	size := proto.Size(m)
	opts := proto.MarshalOptions{UseCachedSize: true} // the size just computed
	if mem.IsBelowBufferPoolingThreshold(size) {
		b, err := opts.Marshal(m)
		if err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(b)}, nil
	}
	buf := reusePool.Get(size)
	b, err := opts.MarshalAppend((*buf)[:0], m)
	if err != nil {
		reusePool.Put(buf)
		return nil, err
	}
	*buf = b
	return mem.BufferSlice{mem.NewBuffer(buf, reusePool)}, nil
}

func (poolCodec) Unmarshal(data mem.BufferSlice, v any) error {
	return encoding.GetCodecV2("proto").Unmarshal(data, v)
}

// reusePool is a mem.BufferPool of power-of-two classes that hands its
// buffers out as they were returned, without clearing them: the codec
// overwrites what it uses.
var reusePool mem.BufferPool = &classPool{}

// classPool keeps buffers of 2^minClassBits to 2^maxClassBits bytes, a
// sync.Pool per size; others are allocated and dropped.
type classPool struct {
	classes [maxClassBits - minClassBits + 1]sync.Pool
}

const (
	minClassBits = 12 // 4 KiB: smaller ones are cheap to allocate
	maxClassBits = 24 // 16 MiB: containerd's largest message
)

func (p *classPool) Get(length int) *[]byte {
	c := bits.Len(uint(length - 1)) // the smallest class that holds length
	if length <= 0 || c < minClassBits || c > maxClassBits {
		b := make([]byte, length)
		return &b
	}
	if b, ok := p.classes[c-minClassBits].Get().(*[]byte); ok {
		*b = (*b)[:length]
		return b
	}
	b := make([]byte, length, 1<<c)
	return &b
}

func (p *classPool) Put(b *[]byte) {
	c := bits.Len(uint(cap(*b))) - 1 // the largest class it holds
	if c < minClassBits || c > maxClassBits {
		return
	}
	*b = (*b)[:cap(*b)]
	p.classes[c-minClassBits].Put(b)
}
