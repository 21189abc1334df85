package main

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/pkg/source"
)

type wrappedOpener struct {
	content.RangeOpener
	desc content.Descriptor
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
	throughSwarm(res, func(d content.Descriptor, op content.RangeOpener) content.RangeOpener {
		return wrappedOpener{RangeOpener: op, desc: d}
	})
	for _, d := range []content.Descriptor{file, packed, manifest, layer} {
		w, ok := res.Blobs[d.Digest].(wrappedOpener)
		require.True(t, ok, "blob %s goes through the swarm", d.Digest)
		require.Equal(t, d, w.desc)
		_, twice := w.RangeOpener.(wrappedOpener)
		require.False(t, twice, "a blob named twice is wrapped once")
	}
}

// Peering needs the cluster CA, or leave to share over plain HTTP.
func TestPeeringNeedsTheCA(t *testing.T) {
	t.Parallel()
	ca, err := peertls.WriteCA(t.TempDir(), "test CA")
	require.NoError(t, err)
	base := p2pConfig{GossipAddr: "127.0.0.1:0", ChunkAddr: "127.0.0.1:0", NodeName: "n1"}
	for name, tc := range map[string]struct {
		edit func(*p2pConfig)
		want string // "" for a peering
	}{
		"no CA":            {func(*p2pConfig) {}, "needs the cluster CA"},
		"no key":           {func(c *p2pConfig) { c.PeerCAFile = ca.CA }, "both"},
		"CA and insecure":  {func(c *p2pConfig) { c.PeerCAFile, c.PeerCAKeyFile, c.PeerInsecure = ca.CA, ca.Key, true }, "choose one"},
		"a key of no CA":   {func(c *p2pConfig) { c.PeerCAFile, c.PeerCAKeyFile = ca.Key, ca.Key }, "no PEM certificate"},
		"the CA":           {func(c *p2pConfig) { c.PeerCAFile, c.PeerCAKeyFile = ca.CA, ca.Key }, ""},
		"plain, when told": {func(c *p2pConfig) { c.PeerInsecure = true }, ""},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := base
			tc.edit(&cfg)
			p, err := newPeering(cfg, slog.New(slog.DiscardHandler), nil)
			if tc.want != "" {
				require.ErrorContains(t, err, tc.want)
				return
			}
			require.NoError(t, err)
			p.chunkLn.Close()
			require.Equal(t, cfg.PeerInsecure, p.identity == nil)
		})
	}
}
