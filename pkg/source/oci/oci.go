package oci

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/singleflight"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// DefaultMaxManifestSize is the largest manifest or index a Source
// accepts by default, in bytes: containerd's limit.
const DefaultMaxManifestSize = 4 << 20

// Source resolves ref.KindOCI references: container images and ModelPack
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
type Source struct {
	base        http.RoundTripper
	short       http.RoundTripper // nil: newLanes picks
	userAgent   string
	insecure    map[string]bool
	keychain    *dockerKeychain
	creds       source.AgentCredentials
	platform    Platform
	maxManifest int64

	handshakes singleflight.Group
	mu         sync.Mutex
	transports map[string]cachedTransport // by registry/repository and RegistryAuth.Key
	challenges map[string]cachedChallenge // by registry
}

// Option configures a Source.
type Option func(*Source)

// WithTransport sets the transport requests go through (default
// http.DefaultTransport). It sees the registry's authentication handshake
// and every request; timeouts are the caller's contexts' and the cache's.
// Requests other than blob reads go through WithShortTransport's.
func WithTransport(t http.RoundTripper) Option {
	return func(s *Source) { s.base = t }
}

// WithShortTransport sets the transport for requests other than blob reads,
// with connections of its own (lanes.go). By default it is a clone of
// WithTransport's when that is an *http.Transport, else that one itself.
func WithShortTransport(t http.RoundTripper) Option {
	return func(s *Source) { s.short = t }
}

// WithVersion sets the version sent in the User-Agent header
// ("weightd/<version>"); the default is "dev".
func WithVersion(version string) Option {
	return func(s *Source) { s.userAgent = "weightd/" + version }
}

// WithInsecureRegistries lets the source speak plain http to the given
// registry hosts (host or host:port, as in references): https is tried
// first, http after. Loopback registries (localhost, 127.0.0.0/8, ::1) are
// always allowed plain http, and so, by go-containerregistry's rule, are
// RFC 1918 addresses.
func WithInsecureRegistries(hosts ...string) Option {
	return func(s *Source) {
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
func WithDockerConfig(path string) Option {
	return func(s *Source) { s.keychain.files = append(s.keychain.files, path) }
}

// WithPullSecret adds the credentials of a Kubernetes image pull secret: the
// content of its .dockerconfigjson key ({"auths": {...}}) or, for the older
// kubernetes.io/dockercfg secrets, its .dockercfg key. Pull secrets are
// tried before Docker config files, in the order given; a secret that does
// not parse makes every resolution fail with a permanent error.
func WithPullSecret(dockerConfigJSON []byte) Option {
	return func(s *Source) {
		auths, err := parseDockerConfig(dockerConfigJSON)
		if err != nil {
			err = fmt.Errorf("pull secret %d: %w", len(s.keychain.secrets)+1, err)
		}
		s.keychain.secrets = append(s.keychain.secrets, dockerAuths{auths: auths, err: err})
	}
}

// WithAgentCredentials says for which requesters (see source.WithRequester)
// resolutions use the agent's credentials (pull secrets, Docker config):
// always for the operator, for a pod's namespace only where a rule names the
// registry and the namespace. The default uses them for the operator alone;
// other resolutions are anonymous.
func WithAgentCredentials(a source.AgentCredentials) Option {
	return func(s *Source) { s.creds = a }
}

// AgentCredentials returns what WithAgentCredentials set: the registry
// mirror, which sends its requests through this source, follows it too.
func (s *Source) AgentCredentials() source.AgentCredentials { return s.creds }

// WithPlatform sets the platform picked from indexes (default: the agent's
// own, see DefaultPlatform). Architecture aliases (x86_64, aarch64) are
// understood; arm64 means arm64/v8.
func WithPlatform(p Platform) Option {
	return func(s *Source) { s.platform = p.normalize() }
}

// WithMaxManifestSize sets the largest manifest or index accepted, in bytes
// (default DefaultMaxManifestSize). A larger one is a permanent error.
func WithMaxManifestSize(n int64) Option {
	return func(s *Source) {
		if n > 0 {
			s.maxManifest = n
		}
	}
}

// New returns an OCI registry source. It starts nothing and makes
// no request until asked.
func New(opts ...Option) *Source {
	s := &Source{
		base:        http.DefaultTransport,
		userAgent:   "weightd/dev",
		insecure:    make(map[string]bool),
		keychain:    &dockerKeychain{},
		platform:    DefaultPlatform(),
		maxManifest: DefaultMaxManifestSize,
		transports:  make(map[string]cachedTransport),
		challenges:  make(map[string]cachedChallenge),
	}
	for _, o := range opts {
		o(s)
	}
	s.base = newLanes(s.base, s.short)
	return s
}

// Resolve fetches the manifest r names (through its index, if any) and
// returns the model or image with one opener per blob.
func (s *Source) Resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	if r.Kind != ref.KindOCI {
		return nil, content.Permanent(fmt.Errorf("resolving %s: kind %q: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	res, err := s.resolve(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", r.Redacted(), err)
	}
	return res, nil
}

func (s *Source) resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	repo, err := s.repository(r.Registry, r.Repository)
	if err != nil {
		return nil, err
	}
	auth := RegistryAuth{Agent: s.creds.Allow(r.Registry, source.Requester(ctx))}
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
	target := source.ImageBlob{Descriptor: content.Descriptor{Digest: top, Size: int64(len(body))}, MediaType: doc.MediaType}
	res := &source.Resolution{Blobs: map[digest.Digest]content.RangeOpener{top: cache.Bytes(body)}}
	var imageBlobs []source.ImageBlob
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
		manifest = source.ImageBlob{Descriptor: want, MediaType: doc.MediaType}
		res.Blobs[want.Digest] = cache.Bytes(body)
	}
	imageBlobs = append(imageBlobs, manifest)

	if isModelManifest(doc) {
		files, packed, err := modelContent(doc)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("model manifest %s: %w", manifest.Digest, err))
		}
		res.Model = content.Model{Name: source.ModelName(r), Revision: top.Encoded(), Files: files}
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
		if !slices.ContainsFunc(imageBlobs, func(ib source.ImageBlob) bool { return ib.Digest == b.Digest }) {
			imageBlobs = append(imageBlobs, b)
		}
	}
	res.Image = &source.Image{Name: imageName(repo, r), Target: target, Blobs: imageBlobs, Public: public}
	rev := top.Encoded()
	if r.Tag != "" {
		rev = fetch.Sanitize(r.Tag, 128, rev)
	}
	res.Model = content.Model{Name: source.ModelName(r), Revision: rev}
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
