package cache

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

// ChunkMap tells what ChunkState tells of which chunks are there, into the
// caller's buffer, without the hashes.
func TestChunkMap(t *testing.T) {
	const cs = 64 << 10
	s, err := Open(t.TempDir(), WithChunkSize(cs), WithBudget(0, 0))
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	data := make([]byte, 10*cs)
	for i := range data {
		data[i] = byte(i / cs)
	}
	desc := content.Descriptor{Digest: digest.FromBytes(data), Size: int64(len(data))}

	_, _, err = s.ChunkMap(desc.Digest, nil)
	require.ErrorIs(t, err, content.ErrNotFound)
	_, _, err = s.ChunkMap("sha256:nope", nil)
	require.ErrorIs(t, err, content.ErrInvalid)

	ctx, cancel := context.WithCancel(context.Background())
	written, done := make(chan struct{}), make(chan error, 1)
	go func() {
		_, err := s.Fetch(ctx, desc, chunkFill(func(ctx context.Context, p *Partial) error {
			for _, i := range []int{0, 3, 9} {
				if err := p.WriteChunk(i, data[i*cs:(i+1)*cs], nil); err != nil {
					return err
				}
			}
			close(written)
			<-ctx.Done()
			return ctx.Err()
		}), nil)
		done <- err
	}()
	<-written
	buf := make([]byte, 0, 8)
	have, complete, err := s.ChunkMap(desc.Digest, buf)
	require.NoError(t, err)
	require.False(t, complete)
	require.Equal(t, []byte{0b1001, 0b10}, have)
	require.Equal(t, &buf[:1][0], &have[0], "in the caller's buffer")
	st, err := s.ChunkState(desc.Digest)
	require.NoError(t, err)
	require.Equal(t, st.Have, have)
	cancel()
	<-done
	// Once the download has stopped, its chunks are not served.
	require.Eventually(t, func() bool {
		_, _, err := s.ChunkMap(desc.Digest, buf)
		return errors.Is(err, content.ErrNotFound)
	}, 10*time.Second, time.Millisecond)

	_, err = s.Fetch(context.Background(), desc, Bytes(data), nil)
	require.NoError(t, err)
	have, complete, err = s.ChunkMap(desc.Digest, buf)
	require.NoError(t, err)
	require.True(t, complete)
	require.Nil(t, have)
}

// chunkFill is a source that fills a download with a function.
type chunkFill func(ctx context.Context, p *Partial) error

func (f chunkFill) Fill(ctx context.Context, p *Partial) error { return f(ctx, p) }

func (chunkFill) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, errors.New("not a stream")
}
