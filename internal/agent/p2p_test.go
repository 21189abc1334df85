package agent

import (
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/peertls"
)

// Peering needs the cluster CA, or leave to share over plain HTTP.
func TestPeeringNeedsTheCA(t *testing.T) {
	t.Parallel()
	ca, err := peertls.WriteCA(t.TempDir(), "test CA")
	require.NoError(t, err)
	base := P2PConfig{GossipAddr: "127.0.0.1:0", ChunkAddr: "127.0.0.1:0", NodeName: "n1"}
	for name, tc := range map[string]struct {
		edit func(*P2PConfig)
		want string // "" for a peering
	}{
		"no CA":            {func(*P2PConfig) {}, "needs the cluster CA"},
		"no key":           {func(c *P2PConfig) { c.PeerCAFile = ca.CA }, "both"},
		"CA and insecure":  {func(c *P2PConfig) { c.PeerCAFile, c.PeerCAKeyFile, c.PeerInsecure = ca.CA, ca.Key, true }, "choose one"},
		"a key of no CA":   {func(c *P2PConfig) { c.PeerCAFile, c.PeerCAKeyFile = ca.Key, ca.Key }, "no PEM certificate"},
		"the CA":           {func(c *P2PConfig) { c.PeerCAFile, c.PeerCAKeyFile = ca.CA, ca.Key }, ""},
		"plain, when told": {func(c *P2PConfig) { c.PeerInsecure = true }, ""},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := base
			tc.edit(&cfg)
			p, err := newPeering(cfg, "dev", slog.New(slog.DiscardHandler), nil)
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

// --origin-limits names origins as ref.Ref.Origin does: Docker Hub's
// aliases are one origin, whatever the case.
func TestOriginLimitsNameOriginsAsRefsDo(t *testing.T) {
	t.Parallel()
	require.Equal(t, map[string]int64{"docker.io": 1 << 20, "hf": 2 << 20, "registry.example:5000": 0},
		originLimits(map[string]bytesize.Size{"Registry-1.Docker.io": 1 << 20, "HF": 2 << 20, "registry.example:5000": 0}))
}
