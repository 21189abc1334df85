package mirror

import (
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// TestBlobHeadersBeforeAnyChunk checks that a GET of a missing blob gets
// its status and headers while the fetch has not received a single byte:
// containerd gives a mirror 30 s to send headers and then goes to the
// registry for good.
func TestBlobHeadersBeforeAnyChunk(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 3*testChunk+5)
	layer := img.layers[0]
	d := digest.FromBytes(layer)
	up.gate, up.gateAt = make(chan struct{}), 0 // not a byte until the gate opens
	tm := newTestMirror(t, up)
	_, _, err := tm.do(t, http.MethodHead, "/v2/library/app/blobs/"+d.String())
	require.NoError(t, err)

	resp, err := tm.srv.Client().Get(tm.srv.URL + "/v2/library/app/blobs/" + d.String())
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, strconv.Itoa(len(layer)), resp.Header.Get("Content-Length"))
	assert.Equal(t, d.String(), resp.Header.Get("Docker-Content-Digest"))
	st, err := tm.store.ChunkState(d)
	if err == nil {
		for i := range 4 {
			assert.False(t, st.Has(i), "chunk %d fetched before the headers went out", i)
		}
	} else {
		require.ErrorIs(t, err, content.ErrNotFound)
	}

	close(up.gate)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, layer, body)
}

// TestBlobFailedFetchSendsTheClientOn checks that a fetch that fails after
// the headers went out cuts the response short, and that the client's
// retry is answered 503 at once, without another fetch, so that containerd
// goes on to the registry.
func TestBlobFailedFetchSendsTheClientOn(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 4*testChunk)
	d := digest.FromBytes(img.layers[0])
	up.lies[d] = randomBytes(77, len(img.layers[0]))
	tm := newTestMirror(t, up, WithLayerPrefetch(false))
	_, _, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
	require.NoError(t, err)

	resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d.String())
	require.Equal(t, http.StatusOK, resp.StatusCode, "the headers go out before the fetch fails")
	require.Error(t, err, "a short body (%d bytes)", len(body))
	opens := up.opens.Load()

	resp, body, err = tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d.String(), "Range", "bytes="+strconv.Itoa(len(body))+"-")
	require.NoError(t, err)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "%s", body)
	assert.Equal(t, opens, up.opens.Load(), "no new fetch")
}

// wantRecorder is a blob source that records where clients wait.
type wantRecorder struct {
	content.RangeOpener
	mu    sync.Mutex
	wants []int64
}

func (w *wantRecorder) Want(off int64) {
	w.mu.Lock()
	w.wants = append(w.wants, off)
	w.mu.Unlock()
}

func (w *wantRecorder) wanted(off int64) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, o := range w.wants {
		if o == off {
			return true
		}
	}
	return false
}

// TestBlobTellsTheSourceWhereTheClientWaits checks that the mirror tells a
// Prioritizer source the byte a streaming client waits on, so the swarm
// can fetch the front of the blob first.
func TestBlobTellsTheSourceWhereTheClientWaits(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 8*testChunk)
	layer := img.layers[0]
	d := digest.FromBytes(layer)
	up.gate, up.gateAt = make(chan struct{}), 2*testChunk
	rec := make(chan *wantRecorder, 1)
	tm := newTestMirror(t, up, WithBlobSource(func(_ content.Descriptor, _ string, upstream content.RangeOpener) content.RangeOpener {
		w := &wantRecorder{RangeOpener: upstream}
		rec <- w
		return w
	}))
	const from = 5*testChunk + 100
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, tm.srv.URL+"/v2/library/app/blobs/"+d.String(), nil)
	require.NoError(t, err)
	req.Header.Set("Range", "bytes="+strconv.Itoa(from)+"-")
	resp, err := tm.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusPartialContent, resp.StatusCode)
	w := <-rec
	require.Eventually(t, func() bool { return w.wanted(from) }, 5*time.Second, 5*time.Millisecond)
	close(up.gate)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, layer[from:], body)
}

// TestManifestStartsItsLayers checks that a GET of an image manifest starts
// the fetch of its config and layers before the client asks for them, and
// that WithLayerPrefetch(false) turns that off.
func TestManifestStartsItsLayers(t *testing.T) {
	t.Parallel()
	for _, on := range []bool{true, false} {
		t.Run(strconv.FormatBool(on), func(t *testing.T) {
			t.Parallel()
			up := newFakeUpstream()
			img := up.addImage(1, "docker.io", "library/app", "v1", 3*testChunk, 1000, 2*testChunk)
			tm := newTestMirror(t, up, WithLayerPrefetch(on))
			resp, _, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
			require.NoError(t, err)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			blobs := []digest.Digest{digest.FromBytes(img.config)}
			for _, l := range img.layers {
				blobs = append(blobs, digest.FromBytes(l))
			}
			held := func() bool {
				for _, d := range blobs {
					if _, err := tm.store.Stat(d); err != nil {
						return false
					}
				}
				return true
			}
			if on {
				require.Eventually(t, held, 5*time.Second, 5*time.Millisecond)
				return
			}
			require.Never(t, func() bool { return up.opens.Load() > 0 }, 200*time.Millisecond, 10*time.Millisecond)
		})
	}
}

// holdingFiller fills a blob of one chunk, verified against the blob's
// digest, then holds its download open, before the store commits the
// blob, until release is closed.
type holdingFiller struct {
	data    []byte
	release chan struct{}
}

func (h *holdingFiller) OpenRange(context.Context, int64) (io.ReadCloser, error) {
	return nil, errors.New("fills only")
}

func (h *holdingFiller) Fill(ctx context.Context, p *cache.Partial) error {
	sum := sha256.Sum256(h.data)
	if err := p.WriteChunk(0, h.data, sum[:]); err != nil {
		return err
	}
	select {
	case <-h.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TestSmallBlobSentBeforeItsCommit checks that a blob of one chunk that
// hashed to its digest is sent whole at once, without waiting for the
// store's commit and its fsyncs.
func TestSmallBlobSentBeforeItsCommit(t *testing.T) {
	t.Parallel()
	up := newFakeUpstream()
	img := up.addImage(1, "docker.io", "library/app", "v1", 1000)
	layer := img.layers[0]
	d := digest.FromBytes(layer)
	filler := &holdingFiller{data: layer, release: make(chan struct{})}
	defer close(filler.release)
	tm := newTestMirror(t, up, WithLayerPrefetch(false), WithBlobSource(func(content.Descriptor, string, content.RangeOpener) content.RangeOpener {
		return filler
	}))
	_, _, err := tm.do(t, http.MethodGet, "/v2/library/app/manifests/v1")
	require.NoError(t, err)
	// The HEAD confirms the client's access: the GET then takes the fill,
	// not the registry's whole answer (confirmBlob), which is committed
	// apart from the response and raced the Stat below.
	resp, _, err := tm.do(t, http.MethodHead, "/v2/library/app/blobs/"+d.String())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)

	resp, body, err := tm.do(t, http.MethodGet, "/v2/library/app/blobs/"+d.String())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, layer, body)
	_, err = tm.store.Stat(d)
	assert.ErrorIs(t, err, content.ErrNotFound, "sent before the blob was committed")
}
