package services

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/weightd/weightd/pkg/containerd"
)

// PullImageCRI pulls ref the way the kubelet does: through the CRI plugin's
// runtime.v1.ImageService/PullImage on the daemon's socket, so the daemon
// itself resolves, fetches (through its registry config_path) and unpacks
// the image. It returns the image reference the CRI answers (the image's
// ID). The messages are encoded by hand to keep k8s.io/cri-api out of the
// module: the request is PullImageRequest{image: ImageSpec{image: ref}},
// the answer PullImageResponse{image_ref}.
func (c *Containerd) PullImageCRI(ctx context.Context, ref string) (string, error) {
	return c.pullImageCRI(ctx, ref, imageSpecRequest(ref))
}

// PullImageCRIAs is PullImageCRI with a pull secret's credentials, as the
// kubelet sends them: PullImageRequest{image, auth: AuthConfig{username,
// password}}, with no server_address, so containerd hands them to whichever
// of the image's hosts (a mirror too) asks for credentials.
func (c *Containerd) PullImageCRIAs(ctx context.Context, ref, username, password string) (string, error) {
	auth := protowire.AppendTag(nil, 1, protowire.BytesType)
	auth = protowire.AppendString(auth, username)
	auth = protowire.AppendTag(auth, 2, protowire.BytesType)
	auth = protowire.AppendString(auth, password)
	req := *imageSpecRequest(ref)
	req = protowire.AppendTag(req, 2, protowire.BytesType)
	req = protowire.AppendBytes(req, auth)
	return c.pullImageCRI(ctx, ref, &req)
}

func (c *Containerd) pullImageCRI(ctx context.Context, ref string, req *[]byte) (string, error) {
	conn, err := grpc.NewClient("unix://"+c.Address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	var resp []byte
	if err := conn.Invoke(ctx, "/runtime.v1.ImageService/PullImage", req, &resp, grpc.ForceCodecV2(containerd.RawCodec{})); err != nil {
		return "", fmt.Errorf("CRI PullImage %s: %w", ref, err)
	}
	id, err := field(resp, 1)
	if err != nil {
		return "", err
	}
	if id == nil {
		return "", fmt.Errorf("CRI PullImage %s: no image_ref in the answer", ref)
	}
	return string(id), nil
}

// CRIImage is what the CRI's ImageStatus says of an image: what the
// kubelet sees.
type CRIImage struct {
	ID          string
	RepoTags    []string
	RepoDigests []string
	Size        uint64
}

// ImageStatusCRI asks the CRI plugin of the daemon listening on address
// (runtime.v1.ImageService) for the status of ref, as the kubelet does
// before deciding to pull: nil when the CRI does not have the image. The
// request is ImageStatusRequest{image: ImageSpec{image: ref}}, the answer
// ImageStatusResponse{image: Image{id, repo_tags, repo_digests, size}}.
func ImageStatusCRI(ctx context.Context, address, ref string) (*CRIImage, error) {
	conn, err := grpc.NewClient("unix://"+address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	var resp []byte
	if err := conn.Invoke(ctx, "/runtime.v1.ImageService/ImageStatus", imageSpecRequest(ref), &resp, grpc.ForceCodecV2(containerd.RawCodec{})); err != nil {
		return nil, fmt.Errorf("CRI ImageStatus %s: %w", ref, err)
	}
	img, err := field(resp, 1)
	if err != nil || img == nil {
		return nil, err
	}
	out := &CRIImage{}
	for b := img; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, protowire.ParseError(n)
		}
		b = b[n:]
		switch {
		case typ == protowire.BytesType:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, protowire.ParseError(n)
			}
			switch num {
			case 1:
				out.ID = string(v)
			case 2:
				out.RepoTags = append(out.RepoTags, string(v))
			case 3:
				out.RepoDigests = append(out.RepoDigests, string(v))
			}
			b = b[n:]
		case typ == protowire.VarintType && num == 4:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return nil, protowire.ParseError(n)
			}
			out.Size = v
			b = b[n:]
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return nil, protowire.ParseError(n)
			}
			b = b[n:]
		}
	}
	return out, nil
}

// imageSpecRequest encodes a request whose field 1 is ImageSpec{image: ref}
// (PullImageRequest, ImageStatusRequest and RemoveImageRequest alike).
func imageSpecRequest(ref string) *[]byte {
	spec := protowire.AppendTag(nil, 1, protowire.BytesType)
	spec = protowire.AppendString(spec, ref)
	req := protowire.AppendTag(nil, 1, protowire.BytesType)
	req = protowire.AppendBytes(req, spec)
	return &req
}

// field returns the first length-delimited field num of a message, or nil.
func field(b []byte, num protowire.Number) ([]byte, error) {
	for len(b) > 0 {
		n, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			return nil, protowire.ParseError(l)
		}
		b = b[l:]
		if n == num && typ == protowire.BytesType {
			v, l := protowire.ConsumeBytes(b)
			if l < 0 {
				return nil, protowire.ParseError(l)
			}
			return v, nil
		}
		l = protowire.ConsumeFieldValue(n, typ, b)
		if l < 0 {
			return nil, protowire.ParseError(l)
		}
		b = b[l:]
	}
	return nil, nil
}

// RemovePodSandboxesCRI stops and removes every pod sandbox of the CRI
// plugin listening on address, as the kubelet does for a deleted pod: the
// containers are killed, the CNI plugin releases the pod's network and its
// namespace is removed. Tests call it after stopping a kubelet, so that no
// container outlives them. ListPodSandboxRequest is empty; its answer holds
// PodSandbox{id} in field 1; Stop- and RemovePodSandboxRequest hold the id
// in field 1.
func RemovePodSandboxesCRI(ctx context.Context, address string) error {
	conn, err := grpc.NewClient("unix://"+address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	empty, resp := []byte{}, []byte{}
	if err := conn.Invoke(ctx, "/runtime.v1.RuntimeService/ListPodSandbox", &empty, &resp, grpc.ForceCodecV2(containerd.RawCodec{})); err != nil {
		return fmt.Errorf("CRI ListPodSandbox: %w", err)
	}
	var ids []string
	for b := resp; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		if num == 1 && typ == protowire.BytesType {
			sandbox, _ := protowire.ConsumeBytes(b)
			id, err := field(sandbox, 1)
			if err != nil {
				return err
			}
			ids = append(ids, string(id))
		}
		b = b[n:]
	}
	var errs []error
	for _, id := range ids {
		req := protowire.AppendTag(nil, 1, protowire.BytesType)
		req = protowire.AppendString(req, id)
		for _, method := range []string{"StopPodSandbox", "RemovePodSandbox"} {
			var out []byte
			if err := conn.Invoke(ctx, "/runtime.v1.RuntimeService/"+method, &req, &out, grpc.ForceCodecV2(containerd.RawCodec{})); err != nil {
				errs = append(errs, fmt.Errorf("CRI %s %s: %w", method, id, err))
				break
			}
		}
	}
	return errors.Join(errs...)
}

// RemoveImageCRI removes ref and every other name of its image from the
// CRI plugin listening on address, as the kubelet's image garbage
// collection does (RemoveImageRequest{image: ImageSpec{image: ref}});
// containerd then collects the image's content that nothing else holds.
func RemoveImageCRI(ctx context.Context, address, ref string) error {
	conn, err := grpc.NewClient("unix://"+address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	var resp []byte
	if err := conn.Invoke(ctx, "/runtime.v1.ImageService/RemoveImage", imageSpecRequest(ref), &resp, grpc.ForceCodecV2(containerd.RawCodec{})); err != nil {
		return fmt.Errorf("CRI RemoveImage %s: %w", ref, err)
	}
	return nil
}
