package hf

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// DefaultEndpoint is the hub Source asks when no endpoint is given.
const DefaultEndpoint = "https://huggingface.co"

// Limits on what a hub may make Source hold or do.
const (
	// MaxInlineFile is the largest file not stored with LFS that Source
	// accepts: such files (configs, tokenizers) are read whole into memory
	// while resolving, to learn their sha256. The hub itself refuses larger
	// ones outside LFS.
	MaxInlineFile = 16 << 20
	// MaxInlineTotal bounds the bytes of all such files of one model.
	MaxInlineTotal = 256 << 20
	// maxListing bounds the bytes of all pages of a tree listing together.
	maxListing = 4 * httpsource.MaxManifestSize
	// maxPages bounds the pages of a tree listing.
	maxPages = 10_000
	// hfInlineFetches is how many small files are read at once.
	hfInlineFetches = 8
	// hfAPITimeout bounds each metadata request and small-file read, body
	// included; a timeout is retried.
	hfAPITimeout = 2 * time.Minute
	// maxDistrusted bounds the commits a Source remembers as wrongly
	// resolved by another node.
	maxDistrusted = 1024
	// maxResolvedFiles bounds the files of the models a Source remembers
	// resolving (a few MiB).
	maxResolvedFiles = 1 << 16
)

// Source resolves ref.KindHF references against a Hugging Face hub (or a
// mirror speaking its API) and reads their files.
//
// Resolving asks the hub which commit the revision names (unless the
// reference already gives a commit), then lists every file of the repository
// at that commit (GET /api/models/{repo}/tree/{commit}?recursive=true,
// following the Link header's pages). A file stored with LFS is known by the
// sha256 and size in the listing and read later with ranged GETs of
// /{repo}/resolve/{commit}/{path}, which the hub redirects to its CDN. A file
// stored in git (config.json, tokenizer files…) has only a git blob id there,
// so it is read whole while resolving (at most MaxInlineFile bytes each,
// MaxInlineTotal together), checked against that id, hashed, and served from
// memory.
//
// The model is named after the repository ("org/name") at the commit, so it
// materialises as models--org--name/snapshots/<commit>/, the hub cache layout.
// A reference to a branch or tag ("main", "v1.0") carries it as the model's
// Ref, so that refs/<branch> is written holding the commit, as the hub's
// own clients write it: offline, a loader finds the model by name and
// branch only through it. A reference pinned to a commit writes no ref.
//
// The token, if any, is sent only for the requesters WithAgentCredentials
// allows, as "Authorization: Bearer …" and only to the
// endpoint's own scheme, host and port: never to the CDN a download is
// redirected to, whatever the client's redirect policy.
type Source struct {
	endpoint *url.URL // no trailing slash
	base     string   // endpoint as a string, no trailing slash
	token    string
	version  string
	http     fetch.Client // makes the requests; its client adds the token
	shared   SharedResolver
	// creds says which requesters the token is sent for; anon resolves
	// for the others (nil without a token).
	creds source.AgentCredentials
	anon  *Source
	// untrusted holds repo@commit listings another node gave wrongly.
	untrusted recent[struct{}]
	// resolved holds the models this node resolved from the hub, by
	// repo@commit: a listing at a commit never changes.
	resolved recent[content.Model]
}

// Option configures a Source.
type Option func(*Source) error

// WithEndpoint sets the hub's base URL (HF_ENDPOINT): an absolute http or
// https URL, possibly with a path prefix, without query, fragment or user
// information. The default is DefaultEndpoint.
func WithEndpoint(endpoint string) Option {
	return func(s *Source) error {
		u, err := url.Parse(strings.TrimRight(endpoint, "/"))
		switch {
		case err != nil:
			if ue, ok := err.(*url.Error); ok {
				err = ue.Err
			}
			return fmt.Errorf("%w: hub endpoint: %v", content.ErrInvalid, err)
		case u.Scheme != "http" && u.Scheme != "https":
			return fmt.Errorf("%w: hub endpoint %q: scheme must be http or https", content.ErrInvalid, fetch.Truncate(endpoint))
		case u.Opaque != "" || u.Host == "" || u.Hostname() == "":
			return fmt.Errorf("%w: hub endpoint %q: want scheme://host[:port][/path]", content.ErrInvalid, fetch.Truncate(endpoint))
		case u.User != nil:
			return fmt.Errorf("%w: hub endpoint %q: user information is not allowed (use a token)", content.ErrInvalid, fetch.Truncate(endpoint))
		case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
			return fmt.Errorf("%w: hub endpoint %q: no query or fragment allowed", content.ErrInvalid, fetch.Truncate(endpoint))
		case u.Port() != "" && !ref.ValidPort(u.Port()):
			return fmt.Errorf("%w: hub endpoint %q: port out of range", content.ErrInvalid, fetch.Truncate(endpoint))
		}
		u.Host = strings.ToLower(u.Host)
		s.endpoint = u
		return nil
	}
}

// WithToken sets the access token (HF_TOKEN) sent to the hub as a bearer
// token; "" sends none. It must be printable ASCII without spaces.
func WithToken(token string) Option {
	return func(s *Source) error {
		for i := 0; i < len(token); i++ {
			if c := token[i]; c <= ' ' || c >= 0x7f {
				return fmt.Errorf("%w: hub token: byte %d is not printable ASCII", content.ErrInvalid, i)
			}
		}
		s.token = token
		return nil
	}
}

// WithAgentCredentials says for which requesters (see source.WithRequester) the
// token is sent: always for the operator, for a pod's namespace only where a
// rule names the hub's host (host[:port] of the endpoint) and the namespace.
// The default sends it for the operator alone. A pod's fetch without the
// token asks the hub as an anonymous client would, and takes no listing
// from peers, which may have resolved it with the token.
func WithAgentCredentials(a source.AgentCredentials) Option {
	return func(s *Source) error {
		s.creds = a
		return nil
	}
}

// WithShared resolves each listing at a commit through shared: once for
// the cluster, the other nodes taking the model from the node that asked the
// hub (see p2p.Swarm.SharedResolve). Without it every resolve asks the hub.
// A listing taken from another node is used only as the hub confirms it:
// its paths, sizes and LFS digests against the hub's listing, its other
// files' bytes against their git blob ids (see Source.confirm); what
// sharing saves is reading every small file on every node.
func WithShared(shared SharedResolver) Option {
	return func(s *Source) error {
		s.shared = shared
		return nil
	}
}

// WithVersion sets the version sent in the User-Agent header
// ("weightd/<version>"); the default is "dev".
func WithVersion(version string) Option {
	return func(s *Source) error {
		s.version = version
		return nil
	}
}

// New returns a source for hub references that makes its requests
// with client (nil: a client with no overall timeout over
// http.DefaultTransport; stalled downloads are the cache's to detect). The
// client's redirect policy applies; the Range header survives redirects, the
// token never leaves the endpoint's host.
func New(client *http.Client, opts ...Option) (*Source, error) {
	s := &Source{version: "dev"}
	if err := WithEndpoint(DefaultEndpoint)(s); err != nil {
		return nil, err
	}
	for _, o := range opts {
		if err := o(s); err != nil {
			return nil, err
		}
	}
	s.base = s.endpoint.String()
	s.untrusted.limit, s.resolved.limit = maxDistrusted, maxResolvedFiles
	if client == nil {
		client = &http.Client{Transport: http.DefaultTransport}
	}
	s.http = fetch.Client{HTTP: client, UserAgent: "weightd/" + s.version}
	if s.token != "" {
		s.anon = &Source{endpoint: s.endpoint, base: s.base, version: s.version, http: s.http}
		s.anon.resolved.limit = maxResolvedFiles
		c := *client
		base := c.Transport
		if base == nil {
			base = http.DefaultTransport
		}
		c.Transport = &authTransport{base: base, origin: origin(s.endpoint), auth: "Bearer " + s.token}
		s.http = fetch.Client{HTTP: &c, UserAgent: "weightd/" + s.version}
	}
	return s, nil
}

// authTransport adds the Authorization header to requests for one origin
// only, so that no redirect can carry it elsewhere.
type authTransport struct {
	base   http.RoundTripper
	origin string
	auth   string
}

func (t *authTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if origin(req.URL) != t.origin || req.Header.Get("Authorization") != "" {
		return t.base.RoundTrip(req)
	}
	r := req.Clone(req.Context())
	r.Header.Set("Authorization", t.auth)
	return t.base.RoundTrip(r)
}

// CloseIdleConnections closes the idle connections of the transport below.
func (t *authTransport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// origin is "scheme://host:port" of u, lower-cased, with the default port
// made explicit.
func origin(u *url.URL) string {
	port := u.Port()
	if port == "" {
		switch u.Scheme {
		case "https":
			port = "443"
		case "http":
			port = "80"
		}
	}
	return strings.ToLower(u.Scheme + "://" + u.Hostname() + ":" + port)
}

// Resolve lists the repository's files at the commit the reference's
// revision names and returns the model with one opener per blob.
func (s *Source) Resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	if r.Kind != ref.KindHF || r.Repository == "" || r.Revision == "" {
		return nil, content.Permanent(fmt.Errorf("resolving %s: kind %q: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	if ns := source.Requester(ctx); s.anon != nil && !s.creds.Allow(s.endpoint.Host, ns) {
		res, err := s.anon.Resolve(ctx, r)
		if err != nil {
			return nil, fmt.Errorf("%w (the agent's hub token is not used for namespace %q)", err, ns)
		}
		return res, nil
	}
	res, err := s.resolve(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", r.Redacted(), err)
	}
	// Set here, not in the listing shared with peers: the ref is this
	// reference's, the listing at the commit any reference's (and a peer's
	// listing names no ref of ours).
	res.Model.Ref = ""
	if !content.IsCommit(r.Revision) {
		if err := content.ValidateRef(r.Revision); err != nil {
			return nil, content.Permanent(fmt.Errorf("resolving %s: %w", r.Redacted(), err))
		}
		res.Model.Ref = r.Revision
	}
	return res, nil
}

func (s *Source) resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	commit := r.Revision
	if !content.IsCommit(commit) {
		var err error
		if commit, err = s.commit(ctx, r.Repository, r.Revision); err != nil {
			return nil, err
		}
	}
	if m, ok := s.resolved.get(r.Repository + "@" + commit); ok {
		return s.resolutionOf(m), nil
	}
	if s.shared == nil || s.distrusted(r.Repository, commit) {
		return s.resolveAt(ctx, r.Repository, commit)
	}
	// The listing at a commit never changes: resolve it once for the
	// cluster, taking another node's answer only as the hub confirms it.
	var (
		own     *source.Resolution
		confirm hubConfirmation
	)
	m, err := s.shared(ctx, ref.Ref{Kind: ref.KindHF, Repository: r.Repository, Revision: commit}, func(ctx context.Context) (content.Model, error) {
		res, err := confirm.resolve(ctx, s, r.Repository, commit)
		if err != nil {
			return content.Model{}, err
		}
		own = res
		return res.Model, nil
	}, func(m content.Model) error { return confirm.check(ctx, s, r.Repository, commit, m) })
	switch {
	case err != nil:
		return nil, err
	case own != nil:
		return own, nil
	}
	return confirm.resolution(s, m), nil
}

// resolveAt lists the repository's files at a commit, reads the small ones
// and returns the model with an opener per blob.
func (s *Source) resolveAt(ctx context.Context, repo, commit string) (*source.Resolution, error) {
	entries, err := s.list(ctx, repo, commit)
	if err != nil {
		return nil, err
	}
	return s.resolveListing(ctx, repo, commit, entries)
}

// resolveListing is resolveAt once the listing is read.
func (s *Source) resolveListing(ctx context.Context, repo, commit string, entries []treeEntry) (*source.Resolution, error) {
	if len(entries) == 0 {
		return nil, content.Permanent(fmt.Errorf("%w: repository has no files at commit %s", content.ErrNotFound, commit))
	}
	if err := checkPaths(entries); err != nil {
		return nil, content.Permanent(fmt.Errorf("hub listing at %s: %w", commit, err))
	}
	res := &source.Resolution{
		Model: content.Model{Name: repo, Revision: commit, Files: make([]content.File, len(entries))},
		Blobs: make(map[digest.Digest]content.RangeOpener),
	}
	var inline []int
	var inlineTotal int64
	for i, e := range entries {
		res.Model.Files[i].Path = e.Path
		if e.LFS == nil {
			if e.Size > MaxInlineFile {
				return nil, content.Permanent(fmt.Errorf("%w: file %q of %d bytes is not stored with LFS and larger than %d", content.ErrInvalid, e.Path, e.Size, MaxInlineFile))
			}
			if inlineTotal += e.Size; inlineTotal > MaxInlineTotal {
				return nil, content.Permanent(fmt.Errorf("%w: files not stored with LFS add up to more than %d bytes", content.ErrInvalid, MaxInlineTotal))
			}
			inline = append(inline, i)
			continue
		}
		d := content.Descriptor{Digest: digest.NewDigestFromEncoded(digest.SHA256, e.LFS.OID), Size: e.Size}
		res.Model.Files[i].Descriptor = d
		if _, ok := res.Blobs[d.Digest]; !ok {
			res.Blobs[d.Digest] = s.blob(s.fileURL(repo, commit, e.Path), e.Size)
		}
	}

	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(hfInlineFetches)
	var mu sync.Mutex
	for _, i := range inline {
		g.Go(func() error {
			e := entries[i]
			data, err := s.fetchSmall(gctx, s.fileURL(repo, commit, e.Path), commit, e)
			if err != nil {
				return fmt.Errorf("file %q: %w", e.Path, err)
			}
			d := content.Descriptor{Digest: digest.FromBytes(data), Size: e.Size}
			mu.Lock()
			defer mu.Unlock()
			res.Model.Files[i].Descriptor = d
			if _, ok := res.Blobs[d.Digest]; !ok {
				res.Blobs[d.Digest] = cache.Bytes(data)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	if err := res.Model.Validate(); err != nil {
		return nil, content.Permanent(fmt.Errorf("hub listing at %s: %w", commit, err))
	}
	m := res.Model
	m.Files = slices.Clone(m.Files)
	s.resolved.add(repo+"@"+commit, m, len(m.Files))
	return res, nil
}

// resolutionOf is the resolution of m, resolved before: every file read
// from the hub at its commit when a store lacks it.
func (s *Source) resolutionOf(m content.Model) *source.Resolution {
	m.Files = slices.Clone(m.Files)
	res := &source.Resolution{Model: m, Blobs: make(map[digest.Digest]content.RangeOpener, len(m.Files))}
	for _, f := range m.Files {
		if _, ok := res.Blobs[f.Digest]; !ok {
			res.Blobs[f.Digest] = s.blob(s.fileURL(m.Name, m.Revision, f.Path), f.Size)
		}
	}
	return res
}

// checkPaths checks, before anything is fetched, that no two files have
// the same path and no file is also another's directory.
func checkPaths(entries []treeEntry) error {
	files := make(map[string]bool, len(entries))
	for _, e := range entries {
		if files[e.Path] {
			return fmt.Errorf("%w: duplicate file %q", content.ErrInvalid, fetch.Truncate(e.Path))
		}
		files[e.Path] = true
	}
	for _, e := range entries {
		for dir := path.Dir(e.Path); dir != "."; dir = path.Dir(dir) {
			if files[dir] {
				return fmt.Errorf("%w: %q is both a file and a directory", content.ErrInvalid, fetch.Truncate(dir))
			}
		}
	}
	return nil
}
