package cache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

// randomBytes returns n reproducible, incompressible bytes.
func randomBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16)})
	r.Read(b)
	return b
}

func descOf(b []byte) content.Descriptor {
	return content.Descriptor{Digest: digest.FromBytes(b), Size: int64(len(b))}
}

// memSource serves a blob from memory with faults a test can switch on.
type memSource struct {
	data []byte

	mu      sync.Mutex
	offsets []int64 // the offset of every OpenRange
	// faults, applied to the first len(...) opens
	dropAfter []int64         // end the stream after this many bytes
	stallFor  []time.Duration // after dropAfter bytes, stall instead of ending
	openErr   error           // returned by every open
	delay     time.Duration   // per 64 KiB read, to slow a download down
}

func (m *memSource) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	i := len(m.offsets)
	m.offsets = append(m.offsets, off)
	if m.openErr != nil {
		return nil, m.openErr
	}
	r := &faultReader{ctx: ctx, r: bytes.NewReader(m.data[off:]), limit: -1, delay: m.delay}
	if i < len(m.dropAfter) {
		r.limit = m.dropAfter[i]
	}
	if i < len(m.stallFor) {
		r.stall = m.stallFor[i]
	}
	return io.NopCloser(r), nil
}

func (m *memSource) opens() []int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]int64(nil), m.offsets...)
}

type faultReader struct {
	ctx   context.Context
	r     io.Reader
	limit int64 // bytes before the fault; -1 for none
	stall time.Duration
	delay time.Duration
}

func (f *faultReader) Read(p []byte) (int, error) {
	if f.limit == 0 {
		if f.stall > 0 {
			select {
			case <-time.After(f.stall):
			case <-f.ctx.Done():
				return 0, f.ctx.Err()
			}
		}
		return 0, errors.New("connection reset by test")
	}
	if f.limit > 0 && int64(len(p)) > f.limit {
		p = p[:f.limit]
	}
	if len(p) > 64<<10 {
		p = p[:64<<10]
	}
	if f.delay > 0 {
		select {
		case <-time.After(f.delay):
		case <-f.ctx.Done():
			return 0, f.ctx.Err()
		}
	}
	n, err := f.r.Read(p)
	if f.limit > 0 {
		f.limit -= int64(n)
	}
	return n, err
}

func openStore(t *testing.T, root string, opts ...Option) *Store {
	t.Helper()
	base := []Option{WithChunkSize(64 << 10), WithRetries(4, time.Millisecond), WithStallTimeout(time.Second), WithBudget(0, 0)}
	s, err := Open(root, append(base, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// requireOnlyVerifiedBlobs checks that every file under blobs/ hashes to its
// name: nothing unverified is ever visible.
func requireOnlyVerifiedBlobs(t *testing.T, root string) {
	t.Helper()
	entries, err := os.ReadDir(blobsDir(root))
	if errors.Is(err, os.ErrNotExist) {
		return // killed before the store made its directories
	}
	require.NoError(t, err)
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(blobsDir(root), e.Name()))
		require.NoError(t, err)
		sum := sha256.Sum256(b)
		require.Equal(t, e.Name(), digest.NewDigestFromBytes(digest.SHA256, sum[:]).Encoded(), "unverified content visible under blobs/")
	}
}
