package services

import (
	"archive/tar"
	"compress/gzip"
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/stream"
	"github.com/opencontainers/go-digest"
)

// PushedImage is an image PushRandomImage pushed.
type PushedImage struct {
	// Ref is "registryAddr/repo:tag".
	Ref string
	// Digest is the manifest's digest; Ref's repository@Digest names it too.
	Digest digest.Digest
	// Size is the bytes of the manifest, the config and the compressed
	// layers: what a pull transfers.
	Size int64
	// Image is the pushed image (its manifest, config and layer digests).
	// Its layers were streamed and cannot be read again.
	Image v1.Image
}

// PushRandomImage pushes to registryAddr (plain HTTP) an image for this
// machine's platform with the given number of gzip tar layers, each holding
// one file of layerSize random bytes (and so a little over layerSize
// compressed). Layers are generated, compressed and uploaded as streams,
// never held in memory: 256 MiB layers are fine. auth may be nil for
// anonymous access.
func PushRandomImage(ctx context.Context, registryAddr, repo, tag string, layers int, layerSize int64, auth authn.Authenticator) (*PushedImage, error) {
	if layers < 1 || layerSize < 0 {
		return nil, fmt.Errorf("pushing a random image: %d layers of %d bytes", layers, layerSize)
	}
	ref, err := name.NewTag(registryAddr+"/"+repo+":"+tag, name.Insecure)
	if err != nil {
		return nil, fmt.Errorf("parsing reference: %w", err)
	}
	if auth == nil {
		auth = authn.Anonymous
	}
	// The config first: a streamed layer's digests are known only once it
	// has been uploaded, and remote.Write computes the final config then.
	cf, err := empty.Image.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = runtime.GOOS, runtime.GOARCH
	cf.Created = v1.Time{Time: time.Now().UTC().Truncate(time.Second)}
	cf.Config.Cmd = []string{"/bin/true"}
	base, err := mutate.ConfigFile(empty.Image, cf)
	if err != nil {
		return nil, err
	}
	ls := make([]v1.Layer, layers)
	for i := range layers {
		ls[i] = stream.NewLayer(randomTar(ctx, i, layerSize), stream.WithCompressionLevel(gzip.BestSpeed))
	}
	img, err := mutate.AppendLayers(base, ls...)
	if err != nil {
		return nil, err
	}
	if err := remote.Write(ref, img, remote.WithAuth(auth), remote.WithContext(ctx)); err != nil {
		return nil, fmt.Errorf("pushing %s: %w", ref, err)
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, err
	}
	d, err := img.Digest()
	if err != nil {
		return nil, err
	}
	raw, err := img.RawManifest()
	if err != nil {
		return nil, err
	}
	size := int64(len(raw)) + m.Config.Size
	for _, l := range m.Layers {
		size += l.Size
	}
	return &PushedImage{Ref: ref.String(), Digest: digest.Digest(d.String()), Size: size, Image: img}, nil
}

// randomTar streams a tar archive of one file of size random bytes (and
// ends early with ctx's error if ctx ends).
func randomTar(ctx context.Context, i int, size int64) io.ReadCloser {
	pr, pw := io.Pipe()
	go func() {
		var seed [32]byte
		_, _ = crand.Read(seed[:])
		src := rand.NewChaCha8(seed)
		tw := tar.NewWriter(pw)
		err := tw.WriteHeader(&tar.Header{
			Name: fmt.Sprintf("data/layer-%d.bin", i), Mode: 0o644, Size: size,
			Typeflag: tar.TypeReg, ModTime: time.Unix(0, 0),
		})
		buf := make([]byte, 1<<20)
		for left := size; err == nil && left > 0; {
			if err = ctx.Err(); err != nil {
				break
			}
			n := min(left, int64(len(buf)))
			_, _ = src.Read(buf[:n])
			_, err = tw.Write(buf[:n])
			left -= n
		}
		if err == nil {
			err = tw.Close()
		}
		pw.CloseWithError(err)
	}()
	return readCloser{pr, func() error { return pr.CloseWithError(errors.New("layer reader closed")) }}
}

type readCloser struct {
	io.Reader
	close func() error
}

func (r readCloser) Close() error { return r.close() }
