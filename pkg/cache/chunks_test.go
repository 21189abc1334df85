package cache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

// fillerFunc adapts a function to ChunkFiller (and RangeOpener, which Fetch
// takes; it is never called when the source fills chunks).
type fillerFunc func(ctx context.Context, p *Partial) error

func (f fillerFunc) Fill(ctx context.Context, p *Partial) error { return f(ctx, p) }

func (fillerFunc) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, errors.New("a chunk filler is not streamed")
}

func chunkOf(data []byte, cs, i int) []byte { return data[i*cs : min((i+1)*cs, len(data))] }

func TestFillOutOfOrderFromManyWriters(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var events []Event
	s := openStore(t, t.TempDir(), WithEvents(func(e Event) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	}))
	const cs = 64 << 10
	data := randomBytes(80, 40*cs+123)
	info, err := s.Fetch(context.Background(), descOf(data), fillerFunc(func(ctx context.Context, p *Partial) error {
		require.Equal(t, 41, p.Chunks())
		order := rand.New(rand.NewPCG(1, 1)).Perm(p.Chunks())
		var wg sync.WaitGroup
		errs := make(chan error, len(order))
		for w := range 4 {
			wg.Go(func() {
				for k := w; k < len(order); k += 4 {
					i := order[k]
					sum := sha256.Sum256(chunkOf(data, cs, i))
					errs <- p.WriteChunk(i, chunkOf(data, cs, i), sum[:])
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				return err
			}
		}
		require.Empty(t, p.Missing())
		return nil
	}), nil)
	require.NoError(t, err)
	require.Equal(t, descOf(data), info.Descriptor)
	f, err := s.Open(info.Digest)
	require.NoError(t, err)
	got, _ := io.ReadAll(f)
	f.Close()
	require.True(t, bytes.Equal(data, got))

	mu.Lock()
	defer mu.Unlock()
	kinds := map[EventKind]int{}
	for _, e := range events {
		kinds[e.Kind]++
	}
	require.Equal(t, map[EventKind]int{EventPartial: 1, EventChunk: 41, EventComplete: 1}, kinds)
}

func TestFillRefusesCorruptChunkAndCatchesWrongChunkMap(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	const cs = 64 << 10
	data := randomBytes(81, 4*cs)
	bad := bytes.Clone(chunkOf(data, cs, 2))
	bad[7] ^= 0xff
	badSum := sha256.Sum256(bad)

	_, err := s.Fetch(context.Background(), descOf(data), fillerFunc(func(ctx context.Context, p *Partial) error {
		good := sha256.Sum256(chunkOf(data, cs, 2))
		// A corrupt chunk against the right hash is refused and not marked.
		require.ErrorIs(t, p.WriteChunk(2, bad, good[:]), content.ErrDigestMismatch)
		require.False(t, p.Has(2))
		require.ErrorIs(t, p.WriteChunk(2, bad[:10], good[:]), content.ErrSizeMismatch)
		require.ErrorIs(t, p.WriteChunk(9, bad, nil), content.ErrInvalid)
		// A lying chunk map: the corrupt chunk with its own hash passes the
		// chunk check, but the whole-blob check catches it.
		for i := range 4 {
			c, want := chunkOf(data, cs, i), []byte(nil)
			if i == 2 {
				c, want = bad, badSum[:]
			}
			require.NoError(t, p.WriteChunk(i, c, want))
		}
		require.ErrorIs(t, p.Verify(), content.ErrDigestMismatch)
		// The swarm refetches the suspect chunk from a trusted source.
		p.Invalidate(2)
		require.Equal(t, []int{2}, p.Missing())
		require.NoError(t, p.WriteChunk(2, chunkOf(data, cs, 2), nil))
		return nil
	}), nil)
	require.NoError(t, err)
	requireOnlyVerifiedBlobs(t, s.Root())
}

func TestFillWithWrongChunkMapIsNotCommitted(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	const cs = 64 << 10
	data := randomBytes(82, 3*cs)
	_, err := s.Fetch(context.Background(), descOf(data), fillerFunc(func(ctx context.Context, p *Partial) error {
		for i := range 3 {
			c := bytes.Clone(chunkOf(data, cs, i))
			c[0] ^= 1
			require.NoError(t, p.WriteChunk(i, c, nil))
		}
		return nil
	}), nil)
	require.ErrorIs(t, err, content.ErrDigestMismatch)
	_, err = s.Stat(descOf(data).Digest)
	require.ErrorIs(t, err, content.ErrNotFound)
	requireOnlyVerifiedBlobs(t, s.Root())
}

func TestChunksOfDownloadInFlightAreServable(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	const cs = 64 << 10
	data := randomBytes(83, 3*cs)
	d := descOf(data).Digest
	_, _, _, err := s.OpenChunk(d, 0)
	require.ErrorIs(t, err, content.ErrNotFound)

	_, err = s.Fetch(context.Background(), descOf(data), fillerFunc(func(ctx context.Context, p *Partial) error {
		require.NoError(t, p.WriteChunk(1, chunkOf(data, cs, 1), nil))
		st, err := s.ChunkState(d)
		require.NoError(t, err)
		require.False(t, st.Complete)
		require.False(t, st.Has(0))
		require.True(t, st.Has(1))
		sum := sha256.Sum256(chunkOf(data, cs, 1))
		require.Equal(t, sum[:], st.Hash(1))
		require.Nil(t, st.Hash(0))
		h, err := s.ChunkHash(d, 1)
		require.NoError(t, err)
		require.Equal(t, sum[:], h)
		_, err = s.ChunkHash(d, 0)
		require.ErrorIs(t, err, content.ErrNotFound)

		_, _, _, err = s.OpenChunk(d, 0)
		require.ErrorIs(t, err, content.ErrNotFound, "a chunk not yet verified is never served")
		f, off, n, err := s.OpenChunk(d, 1)
		require.NoError(t, err)
		got := make([]byte, n)
		_, err = f.ReadAt(got, off)
		f.Close()
		require.NoError(t, err)
		require.Equal(t, chunkOf(data, cs, 1), got)

		require.NoError(t, p.WriteChunk(0, chunkOf(data, cs, 0), nil))
		return p.WriteChunk(2, chunkOf(data, cs, 2), nil)
	}), nil)
	require.NoError(t, err)
	f, off, n, err := s.OpenChunk(d, 2)
	require.NoError(t, err)
	got := make([]byte, n)
	_, err = f.ReadAt(got, off)
	f.Close()
	require.NoError(t, err)
	require.Equal(t, chunkOf(data, cs, 2), got)
	_, _, _, err = s.OpenChunk(d, 3)
	require.ErrorIs(t, err, content.ErrNotFound)
	sum := sha256.Sum256(chunkOf(data, cs, 2))
	h, err := s.ChunkHash(d, 2)
	require.NoError(t, err)
	require.Equal(t, sum[:], h, "of the complete blob")
	_, err = s.ChunkHash(d, 3)
	require.ErrorIs(t, err, content.ErrNotFound)
}

func TestFillResumesScatteredChunksAfterRestart(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	s := openStore(t, root, WithCheckpointInterval(0))
	const cs = 64 << 10
	data := randomBytes(84, 6*cs)
	stop := errors.New("interrupted")
	_, err := s.Fetch(context.Background(), descOf(data), fillerFunc(func(ctx context.Context, p *Partial) error {
		for _, i := range []int{5, 1, 3} {
			require.NoError(t, p.WriteChunk(i, chunkOf(data, cs, i), nil))
		}
		return stop
	}), nil)
	require.ErrorIs(t, err, stop)
	require.NoError(t, s.Close())

	s2 := openStore(t, root)
	_, err = s2.Fetch(context.Background(), descOf(data), fillerFunc(func(ctx context.Context, p *Partial) error {
		require.Equal(t, []int{0, 2, 4}, p.Missing(), "verified chunks survive a restart")
		for _, i := range p.Missing() {
			require.NoError(t, p.WriteChunk(i, chunkOf(data, cs, i), nil))
		}
		return nil
	}), nil)
	require.NoError(t, err)
	requireOnlyVerifiedBlobs(t, root)
}

// TestProgressCountsPeerChunks reports the bytes peers sent apart from the
// rest, once each: a chunk a peer sends again after it is present counts
// nothing more.
func TestProgressCountsPeerChunks(t *testing.T) {
	t.Parallel()
	s := openStore(t, t.TempDir())
	const cs = 64 << 10
	data := randomBytes(81, 4*cs)
	var done, peers atomic.Int64
	_, err := s.Fetch(context.Background(), descOf(data), fillerFunc(func(ctx context.Context, p *Partial) error {
		for i := range p.Chunks() {
			sum := sha256.Sum256(chunkOf(data, cs, i))
			write := p.WriteChunk
			if i%2 == 0 {
				write = p.WritePeerChunk
			}
			if err := write(i, chunkOf(data, cs, i), sum[:]); err != nil {
				return err
			}
		}
		sum := sha256.Sum256(chunkOf(data, cs, 0))
		return p.WritePeerChunk(0, chunkOf(data, cs, 0), sum[:])
	}), func(d, fromPeers, _ int64) {
		done.Store(d)
		peers.Store(fromPeers)
	})
	require.NoError(t, err)
	require.Equal(t, int64(4*cs), done.Load())
	require.Equal(t, int64(2*cs), peers.Load())
}
