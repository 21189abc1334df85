package mirror

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/oci"
)

// Who may have what the mirror holds. The cache is shared by every pod on
// the node, so a manifest or blob is served only to a client the registry
// lets have it:
//
//   - A request carries the client's own credentials when it sent them
//     (containerd sends its pull secret's after the Basic challenge of a 401,
//     see errUnauthorized), else the agent's own where the operator allows
//     the mirror's clients them for that registry (WithAgentCredentials),
//     else none.
//   - Content the registry gave a request without any credentials is public:
//     served to anyone from then on, from the cache, also while the
//     registry is down.
//   - Any other content is served, from the cache or while it is fetched,
//     only once the registry has answered this client's credentials for that
//     repository and digest (a GET of the manifest, a HEAD of the blob),
//     remembered for grantTTL. A registry that refuses the client (401, 403)
//     is the client's answer, never an outage; a registry that cannot be
//     reached leaves such content refused (fail closed).

// grantTTL is how long a registry's yes for one client, repository and
// digest is taken as still true: access revoked at the registry ends at the
// mirror within it.
const grantTTL = time.Minute

// maxGrants bounds the remembered grants; the oldest go first.
const maxGrants = 1 << 14

// requestAuth is whose credentials the upstream requests for r carry.
func (m *Mirror) requestAuth(r *http.Request, registry string) oci.RegistryAuth {
	if user, pass, ok := r.BasicAuth(); ok && (user != "" || pass != "") {
		return oci.RegistryAuth{Username: user, Password: pass}
	}
	return oci.RegistryAuth{Agent: m.opts.agentCreds.Allow(registry, source.UnknownNamespace)}
}

// anonymous reports whether requests with auth carry no credentials.
func anonymous(auth oci.RegistryAuth) bool { return !auth.Own() && !auth.Agent }

// deniedErr is the answer to a client the registry refused: a challenge
// for its own credentials when it sent none, else 403.
func deniedErr(auth oci.RegistryAuth) *apiError {
	if auth.Own() {
		return errDenied
	}
	return errUnauthorized
}

// upstreamErr maps an upstream failure for a client with auth, asking for
// registry/repository, to the error it sees. A refusal also forgets what
// the registry allowed the client in that repository before: access
// revoked there ends at once for everything cached from it.
func (m *Mirror) upstreamErr(err error, auth oci.RegistryAuth, registry, repository string, notFound *apiError) *apiError {
	switch {
	case errors.Is(err, content.ErrNotFound):
		return notFound
	case errors.Is(err, content.ErrDenied):
		m.grants.forget(grantPrefix(auth, registry, repository))
		return deniedErr(auth)
	}
	return errUnavailable
}

// outcomeOf is the metrics outcome of an error answer.
func outcomeOf(aerr *apiError) string {
	switch aerr.status {
	case http.StatusNotFound:
		return outcomeNotFound
	case http.StatusUnauthorized, http.StatusForbidden:
		return outcomeDenied
	}
	return outcomeError
}

// allowed records that the registry gave d of registry/repository to a
// request with auth: to everyone when it carried no credentials.
func (m *Mirror) allowed(auth oci.RegistryAuth, registry, repository string, d digest.Digest) {
	if anonymous(auth) {
		m.public.add(d)
		return
	}
	m.grants.add(grantKey(auth, registry, repository, d))
}

// authorize says whether d of registry/repository may go to a client with
// auth: public content may, other content once the registry says so (see
// above). manifest says which the digest is. A nil error lets it go.
func (m *Mirror) authorize(ctx context.Context, auth oci.RegistryAuth, registry, repository string, d digest.Digest, manifest bool) *apiError {
	if m.public.has(d) || m.grants.has(grantKey(auth, registry, repository, d)) {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, m.opts.manifestTimeout)
	defer cancel()
	var err error
	notFound := errBlobUnknown
	if manifest {
		notFound = errManifestUnknown
		_, _, _, err = m.upstream.Manifest(ctx, auth, registry, repository, d.String())
	} else {
		var size int64
		if size, err = m.upstream.BlobSize(ctx, auth, registry, repository, d); err == nil && size >= 0 {
			m.known.put(d, knownBlob{Size: size})
		}
	}
	if err != nil {
		return m.unconfirmed(ctx, err, auth, registry, repository, d, notFound)
	}
	m.allowed(auth, registry, repository, d)
	return nil
}

// unconfirmed is the answer to a client whose access to d the registry did
// not confirm (err, within ctx): logged unless the client went away.
func (m *Mirror) unconfirmed(ctx context.Context, err error, auth oci.RegistryAuth, registry, repository string, d digest.Digest, notFound *apiError) *apiError {
	if ctx.Err() == nil {
		m.log.Info("the registry did not confirm a client's access to content; not serving it", "registry", registry,
			"repository", repository, "digest", d, "err", err)
	}
	return m.upstreamErr(err, auth, registry, repository, notFound)
}

func grantKey(auth oci.RegistryAuth, registry, repository string, d digest.Digest) string {
	return grantPrefix(auth, registry, repository) + d.String()
}

// grantPrefix begins the keys of the grants to auth in registry/repository.
func grantPrefix(auth oci.RegistryAuth, registry, repository string) string {
	return auth.Key() + "\x00" + registry + "/" + repository + "@"
}

// grants are the registry's recent yeses, each good for grantTTL.
type grants struct {
	mu    sync.Mutex
	until map[string]time.Time
}

func newGrants() *grants { return &grants{until: make(map[string]time.Time)} }

func (g *grants) add(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := time.Now()
	if len(g.until) >= maxGrants {
		for k, t := range g.until {
			if !now.Before(t) || len(g.until) >= maxGrants {
				delete(g.until, k)
			}
		}
	}
	g.until[key] = now.Add(grantTTL)
}

// forget drops the grants whose keys begin with prefix.
func (g *grants) forget(prefix string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for k := range g.until {
		if strings.HasPrefix(k, prefix) {
			delete(g.until, k)
		}
	}
}

func (g *grants) has(key string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	t, ok := g.until[key]
	return ok && time.Now().Before(t)
}

// digestSet is a bounded set of digests, first in first out.
type digestSet struct {
	mu    sync.Mutex
	max   int
	m     map[digest.Digest]struct{}
	order []digest.Digest
}

func newDigestSet(max int) *digestSet {
	return &digestSet{max: max, m: make(map[digest.Digest]struct{})}
}

func (s *digestSet) add(d digest.Digest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[d]; ok {
		return
	}
	s.m[d] = struct{}{}
	s.order = append(s.order, d)
	for len(s.order) > s.max {
		delete(s.m, s.order[0])
		s.order = s.order[1:]
	}
}

func (s *digestSet) has(d digest.Digest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[d]
	return ok
}
