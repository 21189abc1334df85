package containerd_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	ctrimport "github.com/weightd/weightd/pkg/containerd"
)

// BenchmarkImport imports an image of one uncompressed layer of each size
// into a fresh containerd: write the blob over gRPC, unpack, create the
// record. It reports MB/s of the layer.
func BenchmarkImport(b *testing.B) {
	for _, size := range []int64{16 << 20, 256 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			store := openStore(b)
			fx := newFixture(b, store, "registry.example/bench:v1", fixtureOpts{bigLayer: size, seed: 99})
			b.SetBytes(size)
			for b.Loop() {
				b.StopTimer()
				ctd := services.NewContainerdT(b, services.ContainerdConfig{Dir: b.TempDir()})
				im, err := ctrimport.New(ctrimport.Config{Address: ctd.Address}, store)
				require.NoError(b, err)
				b.StartTimer()
				require.NoError(b, im.Import(b.Context(), fx.img))
				b.StopTimer()
				im.Close()
				require.NoError(b, ctd.Close())
				b.StartTimer()
			}
		})
	}
}
