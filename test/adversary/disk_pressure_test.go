package adversary

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
)

// TestDiskPressureFreeFloor is the disk pressure of issue 21: the budget is
// a share of the filesystem's size, not of what is free, so on a disk that
// others (containerd's images, logs) also fill, ordinary fetches within the
// budget pushed free space below the kubelet's eviction threshold. The
// store keeps a floor of free space: it evicts to stay above it, refuses
// what cannot fit above it, and reports it.
func TestDiskPressureFreeFloor(t *testing.T) {
	t.Parallel()
	disk := testdisk.Tmpfs(t, 64<<20)
	store, reg := diskStore(t, filepath.Join(disk, "cache"), cache.WithMinFree(0, cache.DefaultMinFreePercent))
	total, _ := diskSpace(t, disk)
	floor := total * cache.DefaultMinFreePercent / 100 // the agent's default: kubelet's nodefs.available 10%, plus a margin
	require.Equal(t, floor, store.Usage().MinFree, "the floor is reported")
	require.Equal(t, float64(floor), diskMetric(t, reg, "weightd_cache_min_free_bytes"))
	q := diskQueue(t, store)
	o := newDiskOrigin(t)

	// The cache holds a model of 16 MiB.
	old := diskSeed(t, q, o, store, "old/model", 2, 8<<20)

	// Another tenant fills 24 MiB of the disk.
	require.NoError(t, os.WriteFile(filepath.Join(disk, "containerd-images"), diskBytes(1, 24<<20), 0o644))

	// A new model of 16 MiB fits under the budget (80% of 64 MiB), but not
	// above the floor without evicting some of the old one.
	st, err := diskFetch(t, q, o.model(t, "new/model",
		diskFile{path: "a.bin", data: diskBytes(2, 8<<20)}, diskFile{path: "b.bin", data: diskBytes(3, 8<<20)}))
	require.NoError(t, err)
	require.Equal(t, prefetch.StateReady, st.State)
	_, free := diskSpace(t, disk)
	require.GreaterOrEqual(t, free, floor, "the fetch pushed free space below the floor")
	evicted := 0
	for _, info := range old {
		if _, err := store.Stat(info.Digest); err != nil {
			evicted++
		}
	}
	require.Positive(t, evicted, "the old model's blobs make room")

	// A model that cannot fit above the floor even with every unpinned blob
	// gone is refused, and evicts nothing.
	left := len(store.List())
	st, err = diskFetch(t, q, o.model(t, "too/big", diskFile{path: "c.bin", data: diskBytes(4, 32<<20)}))
	t.Logf("refused: %v", err)
	require.ErrorIs(t, err, cache.ErrDiskFull)
	require.Equal(t, prefetch.StateFailed, st.State)
	require.Contains(t, st.Error, "kept free")
	require.Len(t, store.List(), left, "a refused fetch evicts nothing")
	_, free = diskSpace(t, disk)
	require.GreaterOrEqual(t, free, floor)
}
