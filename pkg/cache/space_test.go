package cache

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/content"
)

// TestNeverFitsEvictsNothing: a size that cannot fit even with every
// unpinned blob evicted (over the budget, or over the disk) is refused
// before anything is evicted.
func TestNeverFitsEvictsNothing(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir(), WithBudget(8<<20, 0))
	var stored []digest.Digest
	for i := range 4 {
		data := randomBytes(uint64(60+i), 1<<20)
		_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
		require.NoError(t, err)
		stored = append(stored, descOf(data).Digest)
	}
	require.NoError(t, s.Pin(stored[0], "test"))
	for _, size := range []int64{1 << 55, 8<<20 - 1<<20 + 1} { // 2^55; more than the budget less the pinned blob
		data := randomBytes(70, 16)
		_, err := s.Fetch(context.Background(), content.Descriptor{Digest: digest.FromBytes(data), Size: size}, &memSource{data: data}, nil)
		require.ErrorIs(t, err, ErrDiskFull, "size %d", size)
		require.ErrorContains(t, err, "cannot fit")
	}
	require.Zero(t, testutil.ToFloat64(s.m.evictions))
	for _, d := range stored {
		_, err := s.Stat(d)
		require.NoError(t, err)
	}
	require.Zero(t, s.Usage().PartialBytes, "refused reservations are released")

	// What fits once unpinned blobs go still evicts them, oldest first.
	data := randomBytes(71, 7<<20)
	_, err := s.Fetch(context.Background(), descOf(data), &memSource{data: data}, nil)
	require.NoError(t, err)
	require.Equal(t, 3.0, testutil.ToFloat64(s.m.evictions))
	_, err = s.Stat(stored[0])
	require.NoError(t, err, "the pinned blob stays")
}

// TestMinFree: the store keeps its floor of free space on a disk others
// fill too, evicting to keep it, refusing what cannot fit above it, and
// reports it.
func TestMinFree(t *testing.T) {
	disk := testdisk.Tmpfs(t, 32<<20)
	_, err := Open(filepath.Join(disk, "bad"), WithMinFree(0, 100))
	require.ErrorIs(t, err, content.ErrInvalid)
	reg := prometheus.NewRegistry()
	s := openStore(t, filepath.Join(disk, "cache"), WithRegisterer(reg), WithMinFree(0, 25), WithBudget(0, 0))
	total, _, err := fsSpace(disk)
	require.NoError(t, err)
	floor := total / 4
	require.Equal(t, floor, s.Usage().MinFree)
	require.Equal(t, float64(floor), testutil.ToFloat64(s.m.minFreeBytes))

	old := randomBytes(80, 8<<20)
	_, err = s.Fetch(context.Background(), descOf(old), &memSource{data: old}, nil)
	require.NoError(t, err)
	// Another tenant takes 12 MiB: 12 MiB are left, 8 above the floor.
	require.NoError(t, os.WriteFile(filepath.Join(disk, "filler"), randomBytes(81, 12<<20), 0o644))

	// 10 MiB fit above the floor only once the old blob goes.
	next := randomBytes(82, 10<<20)
	_, err = s.Fetch(context.Background(), descOf(next), &memSource{data: next}, nil)
	require.NoError(t, err)
	_, err = s.Stat(descOf(old).Digest)
	require.ErrorIs(t, err, content.ErrNotFound)
	_, free, err := fsSpace(disk)
	require.NoError(t, err)
	require.GreaterOrEqual(t, free, floor)

	// 13 MiB cannot fit above the floor even with the 10 evicted: refused,
	// and the 10 stay.
	big := randomBytes(83, 13<<20)
	_, err = s.Fetch(context.Background(), descOf(big), &memSource{data: big}, nil)
	require.ErrorIs(t, err, ErrDiskFull)
	require.ErrorContains(t, err, "kept free")
	_, err = s.Stat(descOf(next).Digest)
	require.NoError(t, err)
	requireOnlyVerifiedBlobs(t, s.Root())
}
