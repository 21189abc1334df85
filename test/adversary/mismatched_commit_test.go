package adversary

// Attack 9, a digest-mismatched commit: Partial.WriteChunk checked "already
// present" before writing and marked the chunk after, and fed the
// whole-blob hash from the writer's memory, not from the file. Two accepted
// writers of one chunk with different bytes (an endgame duplicate: the
// origin's bytes, taken on trust, or a peer's checked against the hash its
// own chunk map gives, and a lying peer's checked against the lie) could
// both write; the hash could be fed one writer's bytes while the file kept
// the other's, and a blob that differs from its digest be committed.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// raceChunkSize is both the store's chunk size and the blob's size: a blob
// of one chunk, which every writer races for.
const raceChunkSize = 256 << 10

// raceRounds is how many blobs are raced for.
const raceRounds = 1000

func TestDigestMismatchedCommit(t *testing.T) {
	t.Parallel()
	store, err := cache.Open(t.TempDir(), cache.WithChunkSize(raceChunkSize), cache.WithBudget(0, 0))
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })

	committed, refused := 0, 0
	for round := range raceRounds {
		good := raceBytes(uint64(round), raceChunkSize)
		bad := bytes.Clone(good)
		bad[round%len(bad)] ^= 0xff
		desc := content.Descriptor{Digest: digest.FromBytes(good), Size: int64(len(good))}

		_, err := store.Fetch(context.Background(), desc, &racingWriters{good: good, bad: bad}, nil)
		if err != nil {
			// The lying writer's bytes were kept, and the whole-blob check
			// caught them: refused, never committed.
			require.ErrorIs(t, err, content.ErrDigestMismatch, "round %d", round)
			_, statErr := store.Stat(desc.Digest)
			require.ErrorIs(t, statErr, content.ErrNotFound, "round %d: a refused blob is not in the store", round)
			refused++
			continue
		}
		f, err := store.Open(desc.Digest)
		require.NoError(t, err, "round %d", round)
		h := sha256.New()
		_, err = io.Copy(h, f)
		f.Close()
		require.NoError(t, err, "round %d", round)
		require.Equal(t, desc.Digest, digest.NewDigest(digest.SHA256, h),
			"round %d: the committed blob %s holds other bytes than its digest names", round, desc.Digest)
		committed++
	}
	t.Logf("%d rounds: %d committed, each matching its digest; %d refused", raceRounds, committed, refused)
	require.Positive(t, committed, "the honest writers never won a round")
}

// racingWriters fills a one-chunk blob with three writers released at once:
// the origin's correct bytes (taken on trust: no chunk hash), a peer's
// correct bytes checked against the correct chunk hash, and a lying peer's
// wrong bytes checked against the hash of those wrong bytes, which its own
// chunk map gives.
type racingWriters struct {
	good, bad []byte
}

func (r *racingWriters) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, content.Permanent(errors.New("racingWriters is filled chunk by chunk only"))
}

func (r *racingWriters) Fill(_ context.Context, p *cache.Partial) error {
	goodSum, badSum := sha256.Sum256(r.good), sha256.Sum256(r.bad)
	writers := []struct {
		data, want []byte
	}{
		{r.good, nil},        // the origin
		{r.good, goodSum[:]}, // an honest peer
		{r.bad, badSum[:]},   // a lying peer, true to its own chunk map
	}
	start := make(chan struct{})
	errs := make([]error, len(writers))
	var wg sync.WaitGroup
	for i, w := range writers {
		wg.Go(func() {
			<-start
			errs[i] = p.WriteChunk(0, w.data, w.want)
		})
	}
	close(start)
	wg.Wait()
	return errors.Join(errs...)
}

// raceBytes is n random-looking bytes drawn from seed.
func raceBytes(seed uint64, n int) []byte {
	var key [32]byte
	key[0], key[1], key[2], key[31] = byte(seed), byte(seed>>8), byte(seed>>16), 9
	b := make([]byte, n)
	rand.NewChaCha8(key).Read(b)
	return b
}
