package mirror

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/oci"
)

// Store is what the mirror needs of the cache. *cache.Store implements it.
type Store interface {
	Stat(d digest.Digest) (cache.Info, error)
	Open(d digest.Digest) (*os.File, error)
	OpenChunk(d digest.Digest, i int) (f *os.File, off, n int64, err error)
	ChunkState(d digest.Digest) (cache.ChunkState, error)
	Fetch(ctx context.Context, desc content.Descriptor, src content.RangeOpener, progress content.Progress) (cache.Info, error)
}

var _ Store = (*cache.Store)(nil)

// Upstream is the registry the mirror falls back to (oci.Source).
// Each request carries auth: the client's credentials, the agent's, or
// none. A registry's refusal (401, 403) is an error wrapping
// content.ErrDenied. Its methods are called concurrently.
type Upstream interface {
	// Manifest fetches a manifest by tag or digest. A manifest the registry
	// does not have is an error wrapping content.ErrNotFound.
	Manifest(ctx context.Context, auth oci.RegistryAuth, registry, repository, reference string) (mediaType string, body []byte, d digest.Digest, err error)
	// BlobSize asks the registry for a blob's size (content.ErrNotFound if it
	// has none).
	BlobSize(ctx context.Context, auth oci.RegistryAuth, registry, repository string, d digest.Digest) (int64, error)
	// BlobStart asks the registry for a blob's size and first n bytes in
	// one request (the whole blob when it is no longer than n, unless the
	// registry refuses such a range), as BlobSize for errors.
	BlobStart(ctx context.Context, auth oci.RegistryAuth, registry, repository string, d digest.Digest, n int64) (int64, []byte, error)
	// BlobOpener reads a blob from the registry.
	BlobOpener(auth oci.RegistryAuth, registry, repository string, desc content.Descriptor) content.RangeOpener
}

// BlobSource turns the upstream reader of a blob, from registry (a host,
// as ref.Ref.Registry), into the reader the cache fetches it with: the
// agent puts the peer-to-peer swarm in front.
type BlobSource func(desc content.Descriptor, registry string, upstream content.RangeOpener) content.RangeOpener

// Option configures a Mirror.
type Option func(*options) error

type options struct {
	registries      []string
	agentCreds      source.AgentCredentials
	blobSource      BlobSource
	logger          *slog.Logger
	registerer      prometheus.Registerer
	stateDir        string
	manifestTimeout time.Duration
	fetchTimeout    time.Duration
	pollInterval    time.Duration
	prefetchLayers  bool
}

// WithRegistries sets the registries mirrored (host[:port]; "docker.io" for
// Docker Hub). Requests for any other registry are 404, so that containerd
// goes on to its next host. With exactly one registry, requests without the
// ns query parameter are for it.
func WithRegistries(hosts ...string) Option {
	return func(o *options) error {
		for _, h := range hosts {
			c, ok := canonicalHost(h)
			if !ok {
				return fmt.Errorf("%w: registry %q is not a host[:port]", content.ErrInvalid, h)
			}
			if !slices.Contains(o.registries, c) {
				o.registries = append(o.registries, c)
			}
		}
		return nil
	}
}

// WithAgentCredentials says for which registries a client that sends no
// credentials of its own has the agent's used for it: those with an
// AnyNamespace rule (the mirror cannot tell a client's namespace). The
// default is none: such a client gets what an anonymous one gets, and is
// asked for its own.
func WithAgentCredentials(a source.AgentCredentials) Option {
	return func(o *options) error { o.agentCreds = a; return nil }
}

// WithBlobSource sets how blobs are fetched: fn wraps the upstream reader of
// each blob (the agent puts the swarm in front, so blobs come from peers
// first). The default is the upstream reader itself.
func WithBlobSource(fn BlobSource) Option {
	return func(o *options) error {
		if fn == nil {
			return fmt.Errorf("%w: nil blob source", content.ErrInvalid)
		}
		o.blobSource = fn
		return nil
	}
}

// WithLayerPrefetch sets whether a GET of an image manifest starts the
// fetches of its config and layers at once (the default), before the
// client asks for them one by one.
func WithLayerPrefetch(on bool) Option {
	return func(o *options) error { o.prefetchLayers = on; return nil }
}

// WithLogger sets the logger; the mirror is silent by default.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l != nil {
			o.logger = l
		}
		return nil
	}
}

// WithRegisterer registers the mirror's metrics on r.
func WithRegisterer(r prometheus.Registerer) Option {
	return func(o *options) error { o.registerer = r; return nil }
}

// WithStateDir keeps the tag → manifest mappings in dir (created if needed),
// so a restarted agent still serves tags while the upstream is down. Without
// it they are kept in memory only.
func WithStateDir(dir string) Option {
	return func(o *options) error {
		if dir == "" {
			return fmt.Errorf("%w: empty state directory", content.ErrInvalid)
		}
		o.stateDir = dir
		return nil
	}
}

// WithManifestTimeout bounds each request to the upstream for a manifest or
// a blob's size (default 15 s); a tag then falls back to its last known
// manifest.
func WithManifestTimeout(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("%w: manifest timeout %v", content.ErrInvalid, d)
		}
		o.manifestTimeout = d
		return nil
	}
}

// WithFetchTimeout bounds a blob fetch started by a request (default 1 h).
// The fetch outlives the request that started it, so that a client that
// gives up still leaves the blob in the cache for its retry.
func WithFetchTimeout(d time.Duration) Option {
	return func(o *options) error {
		if d <= 0 {
			return fmt.Errorf("%w: fetch timeout %v", content.ErrInvalid, d)
		}
		o.fetchTimeout = d
		return nil
	}
}

// Mirror serves the distribution pull API (GET and HEAD) from the cache:
//
//	GET /v2/                                   ping
//	GET|HEAD /v2/<name>/manifests/<tag|digest> a manifest
//	GET|HEAD /v2/<name>/blobs/<digest>         a blob, with Range
//
// The registry is the ns query parameter containerd adds when it uses a
// mirror. Mirror starts no goroutines but the blob fetches that requests
// start, which Close ends. Serve it without a WriteTimeout: a blob of
// gigabytes takes what it takes.
type Mirror struct {
	store    Store
	upstream Upstream
	opts     options
	log      *slog.Logger
	m        *metrics
	tags     *tagStore
	known    *knownBlobs
	public   *digestSet    // content the registry gave without credentials
	grants   *grants       // the registry's recent yeses to clients with credentials
	direct   chan struct{} // a place per small blob being asked of the registry whole (confirmBlob)

	ctx    context.Context // parent of the fetches requests start; cancelled by Close
	cancel context.CancelFunc

	mu        sync.Mutex
	downloads map[digest.Digest]*download
	failed    map[digest.Digest]time.Time // blobs whose fetch failed, and when (failedFor)
	closed    bool
	wg        sync.WaitGroup
}

// New returns a mirror of the registries given by WithRegistries, serving
// from store and falling back to upstream.
func New(store Store, upstream Upstream, opts ...Option) (*Mirror, error) {
	if store == nil || upstream == nil {
		return nil, fmt.Errorf("%w: mirror needs a store and an upstream", content.ErrInvalid)
	}
	o := options{
		blobSource:      func(_ content.Descriptor, _ string, up content.RangeOpener) content.RangeOpener { return up },
		logger:          slog.New(slog.DiscardHandler),
		manifestTimeout: 15 * time.Second,
		fetchTimeout:    time.Hour,
		pollInterval:    50 * time.Millisecond,
		prefetchLayers:  true,
	}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	met, err := newMetrics(o.registerer)
	if err != nil {
		return nil, fmt.Errorf("registering mirror metrics: %w", err)
	}
	tags, err := openTagStore(o.stateDir)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Mirror{
		store: store, upstream: upstream, opts: o, log: o.logger, m: met,
		tags: tags, known: newKnownBlobs(maxKnownBlobs),
		public: newDigestSet(maxKnownBlobs), grants: newGrants(), direct: make(chan struct{}, maxDirect),
		ctx: ctx, cancel: cancel,
		downloads: make(map[digest.Digest]*download),
		failed:    make(map[digest.Digest]time.Time),
	}, nil
}

// Close stops the blob fetches that requests started and waits for them.
// Requests after Close fail. It is idempotent.
func (m *Mirror) Close() error {
	m.mu.Lock()
	m.closed = true
	m.mu.Unlock()
	m.cancel()
	m.wg.Wait()
	return nil
}

// ServeHTTP answers one distribution API request.
func (m *Mirror) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Docker-Distribution-API-Version", "registry/2.0")
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		(&apiError{status: http.StatusMethodNotAllowed, code: "UNSUPPORTED", message: "this mirror serves pulls only"}).write(w, r)
		return
	}
	rt, aerr := parsePath(r.URL.EscapedPath())
	if aerr != nil {
		aerr.write(w, r)
		return
	}
	if rt.kind == routePing {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", "2")
		w.WriteHeader(http.StatusOK)
		if r.Method == http.MethodGet {
			_, _ = w.Write([]byte("{}"))
		}
		return
	}
	registry, ok := m.registry(r)
	if !ok {
		m.m.request(rt.kind, outcomeNotFound)
		errNameUnknown.write(w, r)
		return
	}
	switch rt.kind {
	case routeManifest:
		m.serveManifest(w, r, registry, rt)
	case routeBlob:
		m.serveBlob(w, r, registry, rt)
	}
}

// registry returns the mirrored registry a request is for: its ns query
// parameter, or the only registry mirrored when it has none.
func (m *Mirror) registry(r *http.Request) (string, bool) {
	ns := r.URL.Query()["ns"]
	switch {
	case len(ns) == 0:
		if len(m.opts.registries) == 1 {
			return m.opts.registries[0], true
		}
		return "", false
	case len(ns) > 1:
		return "", false
	}
	h, ok := canonicalHost(ns[0])
	if !ok || !slices.Contains(m.opts.registries, h) {
		return "", false
	}
	return h, true
}
