package p2p

import (
	"context"
	"io"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

type wrappedOpener struct {
	content.RangeOpener
	desc   content.Descriptor
	origin string
}

type nopOpener struct{}

func (nopOpener) OpenRange(context.Context, int64) (io.ReadCloser, error) { return nil, io.EOF }

// Every blob of a resolution goes through the swarm: model files, packed
// layers and image blobs alike, each once.
func TestThroughSwarmWrapsEveryBlob(t *testing.T) {
	t.Parallel()
	desc := func(s string) content.Descriptor {
		return content.Descriptor{Digest: digest.FromString(s), Size: int64(len(s))}
	}
	file, packed, manifest, layer := desc("file"), desc("packed"), desc("manifest"), desc("layer")
	res := &source.Resolution{
		Model:  content.Model{Files: []content.File{{Path: "a", Descriptor: file}, {Path: "b", Descriptor: file}}},
		Packed: []source.PackedLayer{{Descriptor: packed}},
		Image:  &source.Image{Blobs: []source.ImageBlob{{Descriptor: manifest}, {Descriptor: layer}}},
		Blobs:  map[digest.Digest]content.RangeOpener{},
	}
	for _, d := range []content.Descriptor{file, packed, manifest, layer} {
		res.Blobs[d.Digest] = nopOpener{}
	}
	throughSwarm(res, "hf", func(d content.Descriptor, origin Origin) content.RangeOpener {
		return wrappedOpener{RangeOpener: origin.RangeOpener, desc: d, origin: origin.Name}
	})
	for _, d := range []content.Descriptor{file, packed, manifest, layer} {
		w, ok := res.Blobs[d.Digest].(wrappedOpener)
		require.True(t, ok, "blob %s goes through the swarm", d.Digest)
		require.Equal(t, d, w.desc)
		require.Equal(t, "hf", w.origin, "named by its origin")
		_, twice := w.RangeOpener.(wrappedOpener)
		require.False(t, twice, "a blob named twice is wrapped once")
	}
}
