package mirror

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/oci"
)

// testChunk is the cache's chunk size in tests: small, so that a blob of a
// few hundred KiB streams in several chunks.
const testChunk = 64 << 10

// randomBytes returns n reproducible, incompressible bytes.
func randomBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16)})
	_, _ = r.Read(b)
	return b
}

// fakeUpstream is an in-memory registry behind the Upstream interface, with
// faults a test can switch on.
type fakeUpstream struct {
	mu        sync.Mutex
	manifests map[string]fakeManifest // registry/repository@reference
	blobs     map[digest.Digest][]byte
	lies      map[digest.Digest][]byte // served instead of the blob's bytes
	down      bool                     // every call fails, not with "not found"
	gate      chan struct{}            // when set, blob reads stop at gateAt until it is closed
	gateAt    int64
	// password, when set, makes the registry private: it gives nothing to
	// a request without it (the agent's credentials hold it).
	password string

	manifestCalls, sizeCalls, startCalls, opens atomic.Int32
}

// refuses says whether the registry refuses a request with auth; u.mu is
// held.
func (u *fakeUpstream) refuses(auth oci.RegistryAuth) error {
	if u.password == "" || auth.Agent && !auth.Own() || auth.Password == u.password {
		return nil
	}
	return fmt.Errorf("401 Unauthorized: %w", content.ErrDenied)
}

type fakeManifest struct {
	mediaType string
	body      []byte
}

func newFakeUpstream() *fakeUpstream {
	return &fakeUpstream{
		manifests: make(map[string]fakeManifest),
		blobs:     make(map[digest.Digest][]byte),
		lies:      make(map[digest.Digest][]byte),
	}
}

func (u *fakeUpstream) setDown(down bool) {
	u.mu.Lock()
	u.down = down
	u.mu.Unlock()
}

var errDown = fmt.Errorf("connection refused")

func (u *fakeUpstream) Manifest(ctx context.Context, auth oci.RegistryAuth, registry, repository, reference string) (string, []byte, digest.Digest, error) {
	u.manifestCalls.Add(1)
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.down {
		return "", nil, "", errDown
	}
	if err := u.refuses(auth); err != nil {
		return "", nil, "", err
	}
	m, ok := u.manifests[registry+"/"+repository+"@"+reference]
	if !ok {
		return "", nil, "", fmt.Errorf("manifest %s: %w", reference, content.ErrNotFound)
	}
	return m.mediaType, m.body, digest.FromBytes(m.body), nil
}

func (u *fakeUpstream) BlobSize(ctx context.Context, auth oci.RegistryAuth, registry, repository string, d digest.Digest) (int64, error) {
	u.sizeCalls.Add(1)
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.down {
		return 0, errDown
	}
	if err := u.refuses(auth); err != nil {
		return 0, err
	}
	b, ok := u.blobs[d]
	if !ok {
		return 0, fmt.Errorf("blob %s: %w", d, content.ErrNotFound)
	}
	return int64(len(b)), nil
}

func (u *fakeUpstream) BlobStart(ctx context.Context, auth oci.RegistryAuth, registry, repository string, d digest.Digest, n int64) (int64, []byte, error) {
	u.startCalls.Add(1)
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.down {
		return 0, nil, errDown
	}
	if err := u.refuses(auth); err != nil {
		return 0, nil, err
	}
	b, ok := u.blobs[d]
	if !ok {
		return 0, nil, fmt.Errorf("blob %s: %w", d, content.ErrNotFound)
	}
	if lie, lying := u.lies[d]; lying {
		b = lie
	}
	return int64(len(b)), bytes.Clone(b[:min(n, int64(len(b)))]), nil
}

func (u *fakeUpstream) BlobOpener(auth oci.RegistryAuth, registry, repository string, desc content.Descriptor) content.RangeOpener {
	return openerFunc(func(ctx context.Context, off int64) (io.ReadCloser, error) {
		u.opens.Add(1)
		u.mu.Lock()
		defer u.mu.Unlock()
		if u.down {
			return nil, errDown
		}
		if err := u.refuses(auth); err != nil {
			return nil, err
		}
		b, ok := u.blobs[desc.Digest]
		if lie, lying := u.lies[desc.Digest]; lying {
			b = lie
		}
		if !ok {
			return nil, content.Permanent(fmt.Errorf("blob %s: %w", desc.Digest, content.ErrNotFound))
		}
		return io.NopCloser(&gatedReader{ctx: ctx, r: bytes.NewReader(b[off:]), pos: off, gate: u.gate, at: u.gateAt}), nil
	})
}

type openerFunc func(ctx context.Context, off int64) (io.ReadCloser, error)

func (f openerFunc) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	return f(ctx, off)
}

// gatedReader stops at byte at until gate is closed.
type gatedReader struct {
	ctx  context.Context
	r    io.Reader
	pos  int64
	gate chan struct{}
	at   int64
}

func (g *gatedReader) Read(p []byte) (int, error) {
	if g.gate != nil && g.pos >= g.at {
		select {
		case <-g.gate:
			g.gate = nil
		case <-g.ctx.Done():
			return 0, g.ctx.Err()
		}
	}
	if g.gate != nil && g.pos+int64(len(p)) > g.at {
		p = p[:g.at-g.pos]
	}
	n, err := g.r.Read(p)
	g.pos += int64(n)
	return n, err
}

// image is a test image: a config, layers and the manifest naming them.
type image struct {
	manifest []byte
	digest   digest.Digest
	config   []byte
	layers   [][]byte
}

// addImage builds an image with layers of the given sizes and serves it as
// registry/repository:tag (and by digest).
func (u *fakeUpstream) addImage(seed uint64, registry, repository, tag string, layerSizes ...int) image {
	img := image{config: []byte(fmt.Sprintf(`{"architecture":"amd64","os":"linux","seed":%d}`, seed))}
	type desc struct {
		MediaType string        `json:"mediaType"`
		Digest    digest.Digest `json:"digest"`
		Size      int64         `json:"size"`
	}
	var layers []desc
	for i, n := range layerSizes {
		b := randomBytes(seed*100+uint64(i), n)
		img.layers = append(img.layers, b)
		layers = append(layers, desc{"application/vnd.oci.image.layer.v1.tar+gzip", digest.FromBytes(b), int64(n)})
	}
	img.manifest, _ = json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaTypeOCIManifest,
		"config":        desc{"application/vnd.oci.image.config.v1+json", digest.FromBytes(img.config), int64(len(img.config))},
		"layers":        layers,
	})
	img.digest = digest.FromBytes(img.manifest)
	u.mu.Lock()
	defer u.mu.Unlock()
	m := fakeManifest{mediaType: mediaTypeOCIManifest, body: img.manifest}
	u.manifests[registry+"/"+repository+"@"+tag] = m
	u.manifests[registry+"/"+repository+"@"+img.digest.String()] = m
	u.blobs[digest.FromBytes(img.config)] = img.config
	for _, l := range img.layers {
		u.blobs[digest.FromBytes(l)] = l
	}
	return img
}

// testMirror is a mirror of docker.io (and example.com, for tests that name
// the registry) over a real store in a temporary directory.
type testMirror struct {
	*Mirror
	store  *cache.Store
	up     *fakeUpstream
	srv    *httptest.Server
	active atomic.Int32 // requests being handled
}

func newTestMirror(t *testing.T, up *fakeUpstream, opts ...Option) *testMirror {
	t.Helper()
	store, err := cache.Open(t.TempDir(), cache.WithChunkSize(testChunk), cache.WithRetries(2, time.Millisecond),
		cache.WithStallTimeout(5*time.Second))
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	return newTestMirrorOn(t, store, up, opts...)
}

func newTestMirrorOn(t *testing.T, store *cache.Store, up *fakeUpstream, opts ...Option) *testMirror {
	t.Helper()
	opts = append([]Option{WithRegistries("docker.io"), WithRegisterer(prometheus.NewRegistry())}, opts...)
	m, err := New(store, up, opts...)
	require.NoError(t, err)
	m.opts.pollInterval = 5 * time.Millisecond
	tm := &testMirror{Mirror: m, store: store, up: up}
	tm.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tm.active.Add(1)
		defer tm.active.Add(-1)
		m.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { tm.srv.Close(); m.Close() })
	return tm
}

// do sends a request to the mirror and reads the whole response.
func (tm *testMirror) do(t *testing.T, method, path string, header ...string) (*http.Response, []byte, error) {
	t.Helper()
	req, err := http.NewRequest(method, tm.srv.URL+path, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := tm.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp, body, err
}

func (tm *testMirror) requests(kind, outcome string) float64 {
	return testutil.ToFloat64(tm.m.requests.WithLabelValues(kind, outcome))
}

// errorCode decodes a distribution error body.
func errorCode(t *testing.T, body []byte) string {
	t.Helper()
	var e struct {
		Errors []errorEntry `json:"errors"`
	}
	require.NoError(t, json.Unmarshal(body, &e), "body %q", body)
	require.Len(t, e.Errors, 1)
	require.NotEmpty(t, e.Errors[0].Message)
	return e.Errors[0].Code
}
