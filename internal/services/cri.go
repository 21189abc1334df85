package services

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// PullImageCRI pulls ref the way the kubelet does: through the CRI plugin's
// runtime.v1.ImageService/PullImage on the daemon's socket, so the daemon
// itself resolves, fetches (through its registry config_path) and unpacks
// the image. It returns the image reference the CRI answers (the image's
// ID). The messages are encoded by hand to keep k8s.io/cri-api out of the
// module: the request is PullImageRequest{image: ImageSpec{image: ref}},
// the answer PullImageResponse{image_ref}.
func (c *Containerd) PullImageCRI(ctx context.Context, ref string) (string, error) {
	conn, err := grpc.NewClient("unix://"+c.Address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	spec := protowire.AppendTag(nil, 1, protowire.BytesType)
	spec = protowire.AppendString(spec, ref)
	req := protowire.AppendTag(nil, 1, protowire.BytesType)
	req = protowire.AppendBytes(req, spec)
	var resp []byte
	if err := conn.Invoke(ctx, "/runtime.v1.ImageService/PullImage", &req, &resp, grpc.ForceCodecV2(rawCodec{})); err != nil {
		return "", fmt.Errorf("CRI PullImage %s: %w", ref, err)
	}
	for b := resp; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return "", protowire.ParseError(n)
		}
		b = b[n:]
		if num == 1 && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return "", protowire.ParseError(n)
			}
			return string(v), nil
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return "", protowire.ParseError(n)
		}
		b = b[n:]
	}
	return "", fmt.Errorf("CRI PullImage %s: no image_ref in the answer", ref)
}

// rawCodec passes already-encoded protobuf messages through gRPC.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(*b)}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*b = data.Materialize()
	return nil
}
