package prefetch

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/singleflight"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
)

// DefaultMaxOCIManifestSize is the largest manifest or index an OCISource
// accepts by default, in bytes: containerd's limit.
const DefaultMaxOCIManifestSize = 4 << 20

// Bounds on the authenticated transports an OCISource keeps.
const (
	ociTransportTTL  = 10 * time.Minute // then credentials are looked up again
	ociMaxTransports = 256
	ociMaxRedirects  = 10
)

// manifestAccept is what an OCISource asks registries for, best first.
var manifestAccept = strings.Join([]string{
	MediaTypeOCIIndex, MediaTypeOCIManifest, MediaTypeDockerList, MediaTypeDockerManifest, MediaTypeModelManifest,
}, ", ")

// OCISource resolves ref.KindOCI references: container images and ModelPack
// model artifacts in OCI registries (the distribution API), with anonymous,
// basic or bearer-token authentication through go-containerregistry.
//
// A reference is resolved to the manifest its tag or digest names (the
// digest verified when pinned); an index (OCI or Docker manifest list) is
// resolved further to the manifest of the source's platform.
//
// A ModelPack model (artifactType or config media type
// application/vnd.cnai.model.config.v1+json, or the manifest media type
// application/vnd.cnai.model.manifest.v1+json of the spec's drafts up to
// v0.0.6, or the "cncf" spellings it moved to in v0.0.7) becomes a model named after the repository (the last component is
// the name, the ones before it, joined with '.', the organisation, each
// sanitised) at the revision of the manifest digest's 64 hex digits (so a
// moved tag makes a new snapshot, never changes one in use). Its raw layers
// are its files, at the path of their org.cncf.model.filepath annotation
// (org.cnai.model.filepath up to v0.0.6);
// its tar, tar+gzip and tar+zstd layers are packed layers extracted at the
// model's root.
//
// A container image (OCI or Docker image config, tar, tar+gzip or tar+zstd
// layers) becomes an Image named "registry/repository:tag" (or
// "@sha256:…" without a tag; Docker Hub as "docker.io/library/…") whose blobs
// are the index (if any), the manifest, the config and the layers, and a
// model of no files named after the repository at the tag (or the digest).
//
// Manifests and indexes are fetched at resolution and served from memory;
// other blobs are read with ranged GETs that follow redirects to object
// stores, sending the registry's credentials only to the registry.
type OCISource struct {
	base        http.RoundTripper
	userAgent   string
	insecure    map[string]bool
	keychain    *dockerKeychain
	creds       AgentCredentials
	platform    Platform
	maxManifest int64

	handshakes singleflight.Group
	mu         sync.Mutex
	transports map[string]cachedTransport // by registry/repository and RegistryAuth.Key
}

type cachedTransport struct {
	rt      http.RoundTripper
	created time.Time
}

// OCIOption configures an OCISource.
type OCIOption func(*OCISource)

// WithOCITransport sets the transport requests go through (default
// http.DefaultTransport). It sees the registry's authentication handshake
// and every request; timeouts are the caller's contexts' and the cache's.
func WithOCITransport(t http.RoundTripper) OCIOption {
	return func(s *OCISource) { s.base = t }
}

// WithOCIVersion sets the version sent in the User-Agent header
// ("weightd/<version>"); the default is "dev".
func WithOCIVersion(version string) OCIOption {
	return func(s *OCISource) { s.userAgent = "weightd/" + version }
}

// WithInsecureRegistries lets the source speak plain http to the given
// registry hosts (host or host:port, as in references): https is tried
// first, http after. Loopback registries (localhost, 127.0.0.0/8, ::1) are
// always allowed plain http, and so, by go-containerregistry's rule, are
// RFC 1918 addresses.
func WithInsecureRegistries(hosts ...string) OCIOption {
	return func(s *OCISource) {
		for _, h := range hosts {
			s.insecure[strings.ToLower(h)] = true
		}
	}
}

// WithDockerConfig adds the credentials of a Docker config.json file (its
// "auths": "auth" as base64 user:password, or "username" and "password",
// "identitytoken", "registrytoken"). The file is read whenever credentials
// are looked up, so a rotated file is picked up; a missing file holds no
// credentials. Credential helpers (credsStore, credHelpers) are not run.
func WithDockerConfig(path string) OCIOption {
	return func(s *OCISource) { s.keychain.files = append(s.keychain.files, path) }
}

// WithPullSecret adds the credentials of a Kubernetes image pull secret: the
// content of its .dockerconfigjson key ({"auths": {...}}) or, for the older
// kubernetes.io/dockercfg secrets, its .dockercfg key. Pull secrets are
// tried before Docker config files, in the order given; a secret that does
// not parse makes every resolution fail with a permanent error.
func WithPullSecret(dockerConfigJSON []byte) OCIOption {
	return func(s *OCISource) {
		auths, err := parseDockerConfig(dockerConfigJSON)
		if err != nil {
			err = fmt.Errorf("pull secret %d: %w", len(s.keychain.secrets)+1, err)
		}
		s.keychain.secrets = append(s.keychain.secrets, dockerAuths{auths: auths, err: err})
	}
}

// WithOCIAgentCredentials says for which requesters (see WithRequester)
// resolutions use the agent's credentials (pull secrets, Docker config):
// always for the operator, for a pod's namespace only where a rule names the
// registry and the namespace. The default uses them for the operator alone;
// other resolutions are anonymous.
func WithOCIAgentCredentials(a AgentCredentials) OCIOption {
	return func(s *OCISource) { s.creds = a }
}

// AgentCredentials returns what WithOCIAgentCredentials set: the registry
// mirror, which sends its requests through this source, follows it too.
func (s *OCISource) AgentCredentials() AgentCredentials { return s.creds }

// WithPlatform sets the platform picked from indexes (default: the agent's
// own, see DefaultPlatform). Architecture aliases (x86_64, aarch64) are
// understood; arm64 means arm64/v8.
func WithPlatform(p Platform) OCIOption {
	return func(s *OCISource) { s.platform = p.normalize() }
}

// WithMaxManifestSize sets the largest manifest or index accepted, in bytes
// (default DefaultMaxOCIManifestSize). A larger one is a permanent error.
func WithMaxManifestSize(n int64) OCIOption {
	return func(s *OCISource) {
		if n > 0 {
			s.maxManifest = n
		}
	}
}

// NewOCISource returns an OCI registry source. It starts nothing and makes
// no request until asked.
func NewOCISource(opts ...OCIOption) *OCISource {
	s := &OCISource{
		base:        http.DefaultTransport,
		userAgent:   "weightd/dev",
		insecure:    make(map[string]bool),
		keychain:    &dockerKeychain{},
		platform:    DefaultPlatform(),
		maxManifest: DefaultMaxOCIManifestSize,
		transports:  make(map[string]cachedTransport),
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Resolve fetches the manifest r names (through its index, if any) and
// returns the model or image with one opener per blob.
func (s *OCISource) Resolve(ctx context.Context, r ref.Ref) (*Resolution, error) {
	if r.Kind != ref.KindOCI {
		return nil, content.Permanent(fmt.Errorf("resolving %s: kind %q: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	res, err := s.resolve(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", r.Redacted(), err)
	}
	return res, nil
}

func (s *OCISource) resolve(ctx context.Context, r ref.Ref) (*Resolution, error) {
	repo, err := s.repository(r.Registry, r.Repository)
	if err != nil {
		return nil, err
	}
	auth := RegistryAuth{Agent: s.creds.Allow(r.Registry, Requester(ctx))}
	public, err := s.anonymous(auth, repo)
	if err != nil {
		return nil, err
	}
	reference := r.Tag
	if r.Digest != "" {
		reference = r.Digest.String()
	}
	ct, body, top, err := s.fetchManifest(ctx, repo, auth, reference, nil)
	if err != nil {
		return nil, err
	}
	doc, isIndex, err := parseOCIDocument(ct, body)
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("manifest %s: %w", top, err))
	}
	target := ImageBlob{Descriptor: content.Descriptor{Digest: top, Size: int64(len(body))}, MediaType: doc.MediaType}
	res := &Resolution{Blobs: map[digest.Digest]content.RangeOpener{top: cache.Bytes(body)}}
	var imageBlobs []ImageBlob
	manifest := target
	if isIndex {
		imageBlobs = append(imageBlobs, target)
		entry, err := selectManifest(doc, s.platform)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("index %s: %w", top, err))
		}
		switch entry.MediaType {
		case MediaTypeOCIIndex, MediaTypeDockerList:
			return nil, content.Permanent(fmt.Errorf("%w: index %s: the entry for %s (%s) is itself an index, which is not supported", content.ErrInvalid, top, s.platform, entry.Digest))
		}
		want := entry.descriptor()
		ct, body, _, err = s.fetchManifest(ctx, repo, auth, entry.Digest.String(), &want)
		if err != nil {
			return nil, err
		}
		if doc, isIndex, err = parseOCIDocument(cmp.Or(entry.MediaType, ct), body); err != nil {
			return nil, content.Permanent(fmt.Errorf("manifest %s: %w", entry.Digest, err))
		}
		if isIndex {
			return nil, content.Permanent(fmt.Errorf("%w: index %s: the entry for %s (%s) is itself an index, which is not supported", content.ErrInvalid, top, s.platform, entry.Digest))
		}
		manifest = ImageBlob{Descriptor: want, MediaType: doc.MediaType}
		res.Blobs[want.Digest] = cache.Bytes(body)
	}
	imageBlobs = append(imageBlobs, manifest)

	if isModelManifest(doc) {
		files, packed, err := modelContent(doc)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("model manifest %s: %w", manifest.Digest, err))
		}
		res.Model = content.Model{Name: modelName(r.Repository), Revision: top.Encoded(), Files: files}
		res.Packed = packed
		clear(res.Blobs) // the manifest and index are not part of the model
		for _, f := range files {
			res.Blobs[f.Digest] = s.blob(repo, auth, f.Descriptor)
		}
		for _, l := range packed {
			res.Blobs[l.Digest] = s.blob(repo, auth, l.Descriptor)
		}
		if err := res.Model.Validate(); err != nil {
			return nil, content.Permanent(fmt.Errorf("model manifest %s: %w", manifest.Digest, err))
		}
		return res, nil
	}

	blobs, err := imageContent(doc)
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("manifest %s: %w", manifest.Digest, err))
	}
	for _, b := range blobs {
		if _, ok := res.Blobs[b.Digest]; !ok {
			res.Blobs[b.Digest] = s.blob(repo, auth, b.Descriptor)
		}
		if !slices.ContainsFunc(imageBlobs, func(ib ImageBlob) bool { return ib.Digest == b.Digest }) {
			imageBlobs = append(imageBlobs, b)
		}
	}
	res.Image = &Image{Name: imageName(repo, r), Target: target, Blobs: imageBlobs, Public: public}
	rev := top.Encoded()
	if r.Tag != "" {
		rev = sanitize(r.Tag, 128, rev)
	}
	res.Model = content.Model{Name: modelName(r.Repository), Revision: rev}
	return res, nil
}

// imageName is the containerd name of an image: registry/repository:tag,
// or @digest without a tag; Docker Hub is "docker.io".
func imageName(repo name.Repository, r ref.Ref) string {
	reg := repo.RegistryStr()
	if reg == name.DefaultRegistry {
		reg = "docker.io"
	}
	n := reg + "/" + repo.RepositoryStr()
	if r.Tag != "" {
		return n + ":" + r.Tag
	}
	return n + "@" + r.Digest.String()
}

// Manifest fetches the manifest or index reference (a tag or a digest)
// names in registry/repository with auth, for the node's registry mirror.
// It returns
// the media type (the document's own, else the one it was served with), the
// bytes as served and their digest, verified when reference is a digest. A
// document larger than the size limit is a permanent error; one the
// registry does not have is an error wrapping content.ErrNotFound, one it
// refuses (401, 403) an error wrapping content.ErrDenied.
func (s *OCISource) Manifest(ctx context.Context, auth RegistryAuth, registry, repository, reference string) (mediaType string, body []byte, d digest.Digest, err error) {
	defer func() {
		if err != nil {
			err = fmt.Errorf("fetching manifest %s/%s:%s: %w", truncate(registry), truncate(repository), truncate(reference), err)
		}
	}()
	repo, err := s.repository(registry, repository)
	if err != nil {
		return "", nil, "", err
	}
	if strings.Contains(reference, ":") {
		if _, err := content.ParseDigest(reference); err != nil {
			return "", nil, "", content.Permanent(err)
		}
	} else if !ref.ValidTag(reference) {
		return "", nil, "", content.Permanent(fmt.Errorf("%w: tag %q", content.ErrInvalid, truncate(reference)))
	}
	ct, body, d, err := s.fetchManifest(ctx, repo, auth, reference, nil)
	if err != nil {
		return "", nil, "", err
	}
	return docMediaType(ct, body), body, d, nil
}

// BlobSize asks the registry, with auth, for the size of blob d of
// registry/repository: HEAD, or a GET of its first byte where HEAD is
// refused (as object stores that registries redirect to may, their URLs
// signed for GET only). A blob the registry does not have is an error
// wrapping content.ErrNotFound, one it refuses an error wrapping
// content.ErrDenied.
func (s *OCISource) BlobSize(ctx context.Context, auth RegistryAuth, registry, repository string, d digest.Digest) (int64, error) {
	size, err := s.blobSize(ctx, auth, registry, repository, d)
	if err != nil {
		return 0, fmt.Errorf("stat blob %s in %s/%s: %w", d, truncate(registry), truncate(repository), err)
	}
	return size, nil
}

func (s *OCISource) blobSize(ctx context.Context, auth RegistryAuth, registry, repository string, d digest.Digest) (int64, error) {
	if err := content.ValidateDigest(d); err != nil {
		return 0, content.Permanent(err)
	}
	repo, err := s.repository(registry, repository)
	if err != nil {
		return 0, err
	}
	resp, err := s.do(ctx, repo, auth, http.MethodHead, "blobs/"+d.String(), nil)
	if err != nil {
		return 0, err
	}
	drainClose(resp.Body)
	redirected := resp.Request.URL.Host != repo.RegistryStr()
	switch c := resp.StatusCode; {
	case c == http.StatusOK && resp.ContentLength >= 0:
		if got := resp.Header.Get("Docker-Content-Digest"); strings.HasPrefix(got, "sha256:") && got != d.String() {
			return 0, content.Permanent(fmt.Errorf("%w: HEAD %s: registry says %s", content.ErrDigestMismatch, redact(resp.Request.URL), truncate(got)))
		}
		return resp.ContentLength, nil
	case c == http.StatusOK, c == http.StatusMethodNotAllowed, c == http.StatusNotImplemented, c == http.StatusForbidden && redirected:
		// No length, HEAD refused, or a redirect to an object store that
		// signed its URL for GET only: ask for the first byte instead.
	default:
		return 0, registryError(resp)
	}
	resp, err = s.do(ctx, repo, auth, http.MethodGet, "blobs/"+d.String(), func(h http.Header) {
		h.Set("Range", "bytes=0-0")
		h.Set("Accept-Encoding", "identity")
	})
	if err != nil {
		return 0, err
	}
	where := "GET " + redact(resp.Request.URL)
	switch resp.StatusCode {
	case http.StatusPartialContent:
		defer drainClose(resp.Body)
		_, _, total, err := parseContentRange(resp.Header.Get("Content-Range"))
		if err != nil || total < 0 {
			return 0, fmt.Errorf("%s: Content-Range %q: want a known total", where, truncate(resp.Header.Get("Content-Range")))
		}
		return total, nil
	case http.StatusOK:
		resp.Body.Close() // the whole blob is coming: do not read it
		if resp.ContentLength < 0 {
			return 0, fmt.Errorf("%s: no Content-Length", where)
		}
		return resp.ContentLength, nil
	case http.StatusRequestedRangeNotSatisfiable:
		drainClose(resp.Body)
		return 0, nil // the only blob with no first byte is the empty one
	default:
		return 0, registryError(resp)
	}
}

// BlobOpener returns an opener of blob desc of registry/repository that
// reads it with ranged GETs with auth (see Resolve). Nothing is checked
// until it is opened.
func (s *OCISource) BlobOpener(auth RegistryAuth, registry, repository string, desc content.Descriptor) content.RangeOpener {
	repo, err := s.repository(registry, repository)
	if err != nil {
		return failedOpener{fmt.Errorf("blob %s: %w", desc.Digest, err)}
	}
	return s.blob(repo, auth, desc)
}

// repository validates registry and repository and names them for
// go-containerregistry.
func (s *OCISource) repository(registry, repository string) (name.Repository, error) {
	registry = strings.ToLower(registry)
	if !ref.ValidRegistry(registry) || !ref.ValidRepository(repository) {
		return name.Repository{}, content.Permanent(fmt.Errorf("%w: %q/%q is not a registry and a repository", content.ErrInvalid, truncate(registry), truncate(repository)))
	}
	var opts []name.Option
	if s.insecure[registry] || isLoopbackHost(registry) {
		opts = append(opts, name.Insecure)
	}
	repo, err := name.NewRepository(registry+"/"+repository, opts...)
	if err != nil {
		return name.Repository{}, content.Permanent(fmt.Errorf("%w: %v", content.ErrInvalid, err))
	}
	return repo, nil
}

// isLoopbackHost reports whether host[:port] is localhost or a loopback
// address.
func isLoopbackHost(host string) bool {
	h := host
	if sh, _, err := net.SplitHostPort(host); err == nil {
		h = sh
	}
	h = strings.Trim(h, "[]")
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// anonymous reports whether requests with auth for repo carry no
// credentials at all: what they fetch, anyone may.
func (s *OCISource) anonymous(auth RegistryAuth, repo name.Repository) (bool, error) {
	if auth.Own() {
		return false, nil
	}
	if !auth.Agent {
		return true, nil
	}
	a, err := s.keychain.Resolve(repo)
	if err != nil {
		return false, content.Permanent(fmt.Errorf("looking up credentials for %s: %w", repo, err))
	}
	return a == authn.Anonymous, nil
}

// authenticator is what requests with auth for repo authenticate with.
func (s *OCISource) authenticator(auth RegistryAuth, repo name.Repository) (authn.Authenticator, error) {
	switch {
	case auth.Own():
		return authn.FromConfig(authn.AuthConfig{Username: auth.Username, Password: auth.Password}), nil
	case auth.Agent:
		return s.keychain.Resolve(repo)
	}
	return authn.Anonymous, nil
}

// transport returns the authenticated transport for repo and auth, doing
// the registry's authentication handshake (ping, token) on first use and
// again after ociTransportTTL.
func (s *OCISource) transport(ctx context.Context, repo name.Repository, auth RegistryAuth) (http.RoundTripper, error) {
	key := repo.RegistryStr() + "/" + repo.RepositoryStr() + "\x00" + auth.Key()
	s.mu.Lock()
	ct, ok := s.transports[key]
	s.mu.Unlock()
	if ok && time.Since(ct.created) < ociTransportTTL {
		return ct.rt, nil
	}
	// One handshake per repository at a time: blobs opened together after
	// the transport expired share it.
	v, err, _ := s.handshakes.Do(key, func() (any, error) {
		authr, err := s.authenticator(auth, repo)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("looking up credentials for %s: %w", repo, err))
		}
		base := transport.NewUserAgent(s.base, s.userAgent)
		rt, err := transport.NewWithContext(ctx, repo.Registry, authr, base, []string{repo.Scope(transport.PullScope)})
		if err != nil {
			return nil, fmt.Errorf("authenticating to %s: %w", repo.RegistryStr(), classifyRegistryErr(err))
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if len(s.transports) >= ociMaxTransports {
			for k, v := range s.transports {
				if time.Since(v.created) >= ociTransportTTL || len(s.transports) >= ociMaxTransports {
					delete(s.transports, k)
				}
			}
		}
		s.transports[key] = cachedTransport{rt: rt, created: time.Now()}
		return rt, nil
	})
	if err != nil {
		return nil, err
	}
	return v.(http.RoundTripper), nil
}

// classifyRegistryErr marks go-containerregistry's HTTP errors that retrying
// cannot fix as permanent.
func classifyRegistryErr(err error) error {
	if s := err.Error(); strings.Contains(s, "invalid realm") || strings.Contains(s, "malformed www-authenticate") {
		// go-containerregistry refuses the token server the registry
		// names (a private address other than the registry's own, or plain
		// http for a registry spoken to over https).
		return content.Permanent(err)
	}
	var te *transport.Error
	if errors.As(err, &te) {
		switch c := te.StatusCode; {
		case c == http.StatusRequestTimeout, c == http.StatusTooEarly, c == http.StatusTooManyRequests:
		case c == http.StatusNotFound:
			return content.Permanent(also{err, content.ErrNotFound})
		case c == http.StatusUnauthorized, c == http.StatusForbidden:
			return content.Permanent(also{err, content.ErrDenied})
		case c >= 400 && c < 500:
			return content.Permanent(err)
		}
	}
	return err
}

// do sends a request for /v2/<repo>/<what> to repo's registry with its
// credentials, following redirects (without the credentials when they leave
// the registry's host).
func (s *OCISource) do(ctx context.Context, repo name.Repository, auth RegistryAuth, method, what string, header func(http.Header)) (*http.Response, error) {
	rt, err := s.transport(ctx, repo, auth)
	if err != nil {
		return nil, err
	}
	u := &url.URL{Scheme: repo.Scheme(), Host: repo.RegistryStr(), Path: "/v2/" + repo.RepositoryStr() + "/" + what}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), nil)
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("%s %s: %w", method, u, err))
	}
	if header != nil {
		header(req.Header)
	}
	client := &http.Client{Transport: rt, CheckRedirect: func(req *http.Request, via []*http.Request) error {
		if len(via) >= ociMaxRedirects {
			return fmt.Errorf("stopped after %d redirects", ociMaxRedirects)
		}
		if req.URL.Host != u.Host {
			req.Header.Del("Authorization")
		}
		return nil
	}}
	resp, err := client.Do(req)
	if err != nil {
		// url.Error repeats the URL, which after a redirect may carry a
		// presigned query.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("%s %s: %w", method, u, classifyRegistryErr(err))
	}
	return resp, nil
}

// fetchManifest GETs a manifest or index by tag or digest, within the size
// limit, and returns its Content-Type, bytes and digest. A reference that is
// a digest is verified; so is want, when given, in digest and size.
func (s *OCISource) fetchManifest(ctx context.Context, repo name.Repository, auth RegistryAuth, reference string, want *content.Descriptor) (string, []byte, digest.Digest, error) {
	resp, err := s.do(ctx, repo, auth, http.MethodGet, "manifests/"+reference, func(h http.Header) {
		h.Set("Accept", manifestAccept)
	})
	if err != nil {
		return "", nil, "", err
	}
	defer drainClose(resp.Body)
	where := "GET " + redact(resp.Request.URL)
	if resp.StatusCode != http.StatusOK {
		return "", nil, "", registryError(resp)
	}
	if resp.ContentLength > s.maxManifest {
		return "", nil, "", content.Permanent(fmt.Errorf("%w: %s: manifest of %d bytes is larger than the limit of %d", content.ErrInvalid, where, resp.ContentLength, s.maxManifest))
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, s.maxManifest+1))
	if err != nil {
		return "", nil, "", fmt.Errorf("%s: %w", where, err)
	}
	if int64(len(body)) > s.maxManifest {
		return "", nil, "", content.Permanent(fmt.Errorf("%w: %s: manifest larger than the limit of %d bytes", content.ErrInvalid, where, s.maxManifest))
	}
	d := digest.FromBytes(body)
	if strings.Contains(reference, ":") && d.String() != reference {
		return "", nil, "", content.Permanent(fmt.Errorf("%w: %s: manifest has digest %s", content.ErrDigestMismatch, where, d))
	}
	if want != nil && int64(len(body)) != want.Size {
		return "", nil, "", content.Permanent(fmt.Errorf("%w: %s: manifest of %d bytes, the index says %d", content.ErrSizeMismatch, where, len(body), want.Size))
	}
	if got := resp.Header.Get("Docker-Content-Digest"); strings.HasPrefix(got, "sha256:") && got != d.String() {
		return "", nil, "", fmt.Errorf("%w: %s: registry says %s, the bytes are %s", content.ErrDigestMismatch, where, truncate(got), d)
	}
	return contentTypeOf(resp.Header.Get("Content-Type")), body, d, nil
}

// registryError describes an unexpected response, with the registry's own
// error codes when its body has them; see statusError for which are
// permanent. A 404 also wraps content.ErrNotFound, a 401 or 403
// content.ErrDenied.
func registryError(resp *http.Response) error {
	var detail string
	if resp.Request.Method != http.MethodHead {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		detail = registryDiagnostics(body)
	}
	err := statusError(resp, resp.Request.URL)
	if detail != "" {
		err = fmt.Errorf("%w: %s", err, detail)
	}
	switch resp.StatusCode {
	case http.StatusNotFound:
		err = also{err, content.ErrNotFound}
	case http.StatusUnauthorized, http.StatusForbidden:
		err = also{err, content.ErrDenied}
	}
	return err
}

// registryDiagnostics summarises the distribution API's error body:
// {"errors": [{"code": …, "message": …}]}.
func registryDiagnostics(body []byte) string {
	var v struct {
		Errors []struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"errors"`
	}
	if json.Unmarshal(body, &v) != nil {
		return ""
	}
	var parts []string
	for _, e := range v.Errors {
		if len(parts) == 3 {
			break
		}
		s := strings.TrimSpace(e.Code + ": " + e.Message)
		parts = append(parts, truncate(strings.Trim(s, ": ")))
	}
	return strings.Join(parts, "; ")
}

// also is err, also matching target with errors.Is.
type also struct {
	error
	target error
}

func (a also) Unwrap() []error { return []error{a.error, a.target} }

// blob reads one blob of repo with ranged GETs ("Range: bytes=off-(end-1)",
// the last byte always given: some registries, go-containerregistry's among
// them, do not understand "bytes=off-"), following redirects. A 206 must
// carry "Content-Range: bytes off-(end-1)/size"; a 200 is accepted only from
// offset 0, with the expected length. A total other than the blob's size is
// a permanent content.ErrSizeMismatch. The bytes are not checked here: the
// cache verifies the digest.
func (s *OCISource) blob(repo name.Repository, auth RegistryAuth, desc content.Descriptor) rangedBlob {
	return rangedBlob{size: desc.Size, fetch: func(ctx context.Context, off, end int64) (io.ReadCloser, error) {
		if err := content.ValidateDigest(desc.Digest); err != nil {
			return nil, content.Permanent(err)
		}
		resp, err := s.do(ctx, repo, auth, http.MethodGet, "blobs/"+desc.Digest.String(), rangeHeader(off, end, desc.Size, true))
		if err != nil {
			return nil, fmt.Errorf("blob %s: %w", desc.Digest, err)
		}
		if err := checkRegistryRange(resp, off, end, desc.Size); err != nil {
			drainClose(resp.Body) // closed already after an unexpected status; closing again is harmless
			if se := (*StatusError)(nil); !errors.As(err, &se) {
				err = fmt.Errorf("GET %s: %w", redact(resp.Request.URL), err)
			}
			return nil, fmt.Errorf("blob %s: %w", desc.Digest, err)
		}
		return resp.Body, nil
	}}
}

// checkRegistryRange is checkRange for a registry: a 200 that ignored the
// range of a resumed read is refused, and other statuses are the registry's
// errors.
func checkRegistryRange(resp *http.Response, off, end, size int64) error {
	if resp.StatusCode == http.StatusOK && off != 0 {
		return content.Permanent(fmt.Errorf("%w: origin ignored Range and sent the whole blob; resuming from byte %d needs ranges", content.ErrInvalid, off))
	}
	err := checkRange(resp, off, end, size)
	if errors.Is(err, errUnexpectedStatus) {
		return registryError(resp)
	}
	return err
}

// failedOpener fails every open with err.
type failedOpener struct{ err error }

func (f failedOpener) OpenRange(context.Context, int64) (io.ReadCloser, error) { return nil, f.err }

// dockerKeychain is an authn.Keychain over pull secrets and Docker config
// files: the first pull secret with credentials for the registry, else the
// first file, else anonymous.
type dockerKeychain struct {
	secrets []dockerAuths
	files   []string
}

// dockerAuths is the parsed "auths" of one Docker config, or why it did
// not parse.
type dockerAuths struct {
	auths map[string]dockerAuth
	err   error
}

// dockerAuth is one entry of a Docker config's "auths".
type dockerAuth struct {
	Auth          string `json:"auth"`
	Username      string `json:"username"`
	Password      string `json:"password"`
	IdentityToken string `json:"identitytoken"`
	RegistryToken string `json:"registrytoken"`
}

// Resolve implements authn.Keychain.
func (k *dockerKeychain) Resolve(r authn.Resource) (authn.Authenticator, error) {
	for _, s := range k.secrets {
		if s.err != nil {
			return nil, s.err
		}
		if a, ok, err := lookupAuth(s.auths, r); err != nil || ok {
			return a, err
		}
	}
	for _, f := range k.files {
		data, err := os.ReadFile(f)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading Docker config: %w", err)
		}
		auths, err := parseDockerConfig(data)
		if err != nil {
			return nil, fmt.Errorf("reading Docker config %s: %w", f, err)
		}
		if a, ok, err := lookupAuth(auths, r); err != nil || ok {
			return a, err
		}
	}
	return authn.Anonymous, nil
}

// parseDockerConfig parses a Docker config.json ({"auths": {...}}) or the
// older .dockercfg (the map of registries alone).
func parseDockerConfig(data []byte) (map[string]dockerAuth, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		return nil, fmt.Errorf("%w: not a Docker config: %v", content.ErrInvalid, err)
	}
	raw, ok := top["auths"]
	if !ok {
		if !isDockercfg(top) {
			return nil, nil // a config.json without auths
		}
		raw = data
	}
	var auths map[string]dockerAuth
	if err := json.Unmarshal(raw, &auths); err != nil {
		return nil, fmt.Errorf("%w: Docker config auths: %v", content.ErrInvalid, err)
	}
	return auths, nil
}

// isDockercfg reports whether a config without "auths" is the older
// .dockercfg: registries mapped to objects, none of the keys the Docker
// CLI's config.json has besides "auths".
func isDockercfg(top map[string]json.RawMessage) bool {
	if len(top) == 0 {
		return false
	}
	for k, v := range top {
		switch k {
		case "credsStore", "credHelpers", "HttpHeaders", "proxies", "plugins", "aliases", "features", "currentContext", "psFormat", "imagesFormat", "detachKeys", "experimental":
			return false
		}
		if v = bytes.TrimSpace(v); len(v) == 0 || v[0] != '{' {
			return false
		}
	}
	return true
}

// lookupAuth finds the credentials for r among auths, kubelet's way: keys
// may have a scheme, a path (a prefix of the repository) and '*' globs in
// host labels; the longest matching key wins; Docker Hub is known by all its
// names.
func lookupAuth(auths map[string]dockerAuth, r authn.Resource) (authn.Authenticator, bool, error) {
	reg := r.RegistryStr()
	repoPath := strings.TrimPrefix(strings.TrimPrefix(r.String(), reg), "/")
	best, bestLen := "", -1
	for key := range auths {
		host, keyPath := normalizeAuthKey(key)
		if !hostMatches(host, reg) {
			continue
		}
		if keyPath != "" && repoPath != keyPath && !strings.HasPrefix(repoPath, keyPath+"/") {
			continue
		}
		if l := len(host) + len(keyPath); l > bestLen || (l == bestLen && key < best) {
			best, bestLen = key, l
		}
	}
	if bestLen < 0 {
		return nil, false, nil
	}
	e := auths[best]
	cfg := authn.AuthConfig{Username: e.Username, Password: e.Password, IdentityToken: e.IdentityToken, RegistryToken: e.RegistryToken}
	if e.Auth != "" {
		dec, err := base64.StdEncoding.DecodeString(e.Auth)
		if err != nil {
			return nil, false, fmt.Errorf("%w: credentials for %q: auth is not base64", content.ErrInvalid, truncate(best))
		}
		user, pass, ok := strings.Cut(string(dec), ":")
		if !ok {
			return nil, false, fmt.Errorf("%w: credentials for %q: auth is not user:password", content.ErrInvalid, truncate(best))
		}
		cfg.Username, cfg.Password = user, pass
	}
	return authn.FromConfig(cfg), true, nil
}

// normalizeAuthKey splits a Docker config key into its host (lower case,
// Docker Hub as index.docker.io) and repository path prefix.
func normalizeAuthKey(key string) (host, keyPath string) {
	k := strings.ToLower(key)
	k = strings.TrimPrefix(strings.TrimPrefix(k, "https://"), "http://")
	host, keyPath, _ = strings.Cut(k, "/")
	keyPath = strings.Trim(path.Clean("/"+keyPath), "/")
	switch host {
	case "docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com":
		host = name.DefaultRegistry
		if keyPath == "v1" || keyPath == "v2" {
			keyPath = ""
		}
	}
	return host, keyPath
}

// hostMatches matches a registry host[:port] against a key host that may
// have '*' globs in its labels (kubelet's rule: as many labels, each
// matching, same port).
func hostMatches(pattern, host string) bool {
	if pattern == host {
		return true
	}
	if !strings.Contains(pattern, "*") {
		return false
	}
	ph, pp := splitPort(pattern)
	hh, hp := splitPort(host)
	if pp != hp {
		return false
	}
	pl, hl := strings.Split(ph, "."), strings.Split(hh, ".")
	if len(pl) != len(hl) {
		return false
	}
	for i := range pl {
		if ok, err := path.Match(pl[i], hl[i]); err != nil || !ok {
			return false
		}
	}
	return true
}

func splitPort(hostport string) (host, port string) {
	if h, p, err := net.SplitHostPort(hostport); err == nil {
		return h, p
	}
	return hostport, ""
}
