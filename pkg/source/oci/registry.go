package oci

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// Bounds on the authenticated transports a Source keeps.
const (
	transportTTL  = 10 * time.Minute // then credentials are looked up again
	maxTransports = 256
	maxRedirects  = 10
)

// manifestAccept is what a Source asks registries for, best first.
var manifestAccept = strings.Join([]string{
	MediaTypeOCIIndex, MediaTypeOCIManifest, MediaTypeDockerList, MediaTypeDockerManifest, MediaTypeModelManifest,
}, ", ")

type cachedTransport struct {
	rt      http.RoundTripper
	scheme  string // the registry's, as its ping found it
	expires time.Time
}

type cachedChallenge struct {
	ch      *transport.Challenge
	expires time.Time
}

// Manifest fetches the manifest or index reference (a tag or a digest)
// names in registry/repository with auth, for the node's registry mirror.
// It returns
// the media type (the document's own, else the one it was served with), the
// bytes as served and their digest, verified when reference is a digest. A
// document larger than the size limit is a permanent error; one the
// registry does not have is an error wrapping content.ErrNotFound, one it
// refuses (401, 403) an error wrapping content.ErrDenied.
func (s *Source) Manifest(ctx context.Context, auth RegistryAuth, registry, repository, reference string) (mediaType string, body []byte, d digest.Digest, err error) {
	defer func() {
		if err != nil {
			err = fmt.Errorf("fetching manifest %s/%s:%s: %w", fetch.Truncate(registry), fetch.Truncate(repository), fetch.Truncate(reference), err)
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
		return "", nil, "", content.Permanent(fmt.Errorf("%w: tag %q", content.ErrInvalid, fetch.Truncate(reference)))
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
func (s *Source) BlobSize(ctx context.Context, auth RegistryAuth, registry, repository string, d digest.Digest) (int64, error) {
	size, err := s.blobSize(ctx, auth, registry, repository, d)
	if err != nil {
		return 0, fmt.Errorf("stat blob %s in %s/%s: %w", d, fetch.Truncate(registry), fetch.Truncate(repository), err)
	}
	return size, nil
}

func (s *Source) blobSize(ctx context.Context, auth RegistryAuth, registry, repository string, d digest.Digest) (int64, error) {
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
	fetch.DrainClose(resp.Body)
	redirected := resp.Request.URL.Host != repo.RegistryStr()
	switch c := resp.StatusCode; {
	case c == http.StatusOK && resp.ContentLength >= 0:
		if got := resp.Header.Get("Docker-Content-Digest"); strings.HasPrefix(got, "sha256:") && got != d.String() {
			return 0, content.Permanent(fmt.Errorf("%w: HEAD %s: registry says %s", content.ErrDigestMismatch, fetch.Redact(resp.Request.URL), fetch.Truncate(got)))
		}
		return resp.ContentLength, nil
	case c == http.StatusOK, c == http.StatusMethodNotAllowed, c == http.StatusNotImplemented, c == http.StatusForbidden && redirected:
		// No length, HEAD refused, or a redirect to an object store that
		// signed its URL for GET only: ask for the first byte instead.
	default:
		return 0, registryError(resp)
	}
	size, _, err := s.blobStart(ctx, repo, auth, d, 1)
	return size, err
}

// BlobStart asks the registry, with auth, for the first n bytes of blob d of
// registry/repository (n > 0) in one GET, and returns the blob's size and
// the first bytes it sent: the whole blob when it is no longer than n,
// unless the registry refuses a range past the end (then one byte, asked
// for next). Errors are BlobSize's. The bytes are not checked here: the
// caller hashes a whole blob.
func (s *Source) BlobStart(ctx context.Context, auth RegistryAuth, registry, repository string, d digest.Digest, n int64) (size int64, start []byte, err error) {
	defer func() {
		if err != nil {
			err = fmt.Errorf("blob %s in %s/%s: %w", d, fetch.Truncate(registry), fetch.Truncate(repository), err)
		}
	}()
	if err := content.ValidateDigest(d); err != nil {
		return 0, nil, content.Permanent(err)
	}
	if n <= 0 {
		return 0, nil, content.Permanent(fmt.Errorf("%w: the first %d bytes of a blob", content.ErrInvalid, n))
	}
	repo, err := s.repository(registry, repository)
	if err != nil {
		return 0, nil, err
	}
	return s.blobStart(ctx, repo, auth, d, n)
}

// blobStart is BlobStart for a validated repository.
func (s *Source) blobStart(ctx context.Context, repo name.Repository, auth RegistryAuth, d digest.Digest, n int64) (int64, []byte, error) {
	resp, err := s.do(ctx, repo, auth, http.MethodGet, "blobs/"+d.String(), func(h http.Header) {
		h.Set("Range", fmt.Sprintf("bytes=0-%d", n-1))
		h.Set("Accept-Encoding", "identity")
	})
	if err != nil {
		return 0, nil, err
	}
	where := "GET " + fetch.Redact(resp.Request.URL)
	var size, want int64
	switch resp.StatusCode {
	case http.StatusPartialContent:
		first, last, total, err := fetch.ParseContentRange(resp.Header.Get("Content-Range"))
		if err != nil || total < 0 || first != 0 || last >= min(n, total) {
			fetch.DrainClose(resp.Body)
			return 0, nil, fmt.Errorf("%s: Content-Range %q for the first %d bytes", where, fetch.Truncate(resp.Header.Get("Content-Range")), n)
		}
		size, want = total, last+1
	case http.StatusOK:
		// The registry ignored the range: read the blob only if it is short.
		if resp.ContentLength < 0 || resp.ContentLength > n {
			resp.Body.Close()
			if resp.ContentLength < 0 {
				return 0, nil, fmt.Errorf("%s: no Content-Length", where)
			}
			return resp.ContentLength, nil, nil
		}
		size, want = resp.ContentLength, resp.ContentLength
	case http.StatusRequestedRangeNotSatisfiable:
		fetch.DrainClose(resp.Body)
		if n > 1 {
			// Some registries (go-containerregistry's) refuse a range past
			// the end instead of cutting it short: ask for the first byte.
			return s.blobStart(ctx, repo, auth, d, 1)
		}
		return 0, nil, nil // the only blob with no first byte is the empty one
	default:
		return 0, nil, registryError(resp)
	}
	defer fetch.DrainClose(resp.Body)
	start, err := io.ReadAll(io.LimitReader(resp.Body, want+1))
	if err == nil && int64(len(start)) != want {
		err = fmt.Errorf("%w: %d bytes where %d were promised", content.ErrSizeMismatch, len(start), want)
	}
	if err != nil {
		return 0, nil, fmt.Errorf("%s: %w", where, err)
	}
	return size, start, nil
}

// BlobOpener returns an opener of blob desc of registry/repository that
// reads it with ranged GETs with auth (see Resolve). Nothing is checked
// until it is opened.
func (s *Source) BlobOpener(auth RegistryAuth, registry, repository string, desc content.Descriptor) content.RangeOpener {
	repo, err := s.repository(registry, repository)
	if err != nil {
		return failedOpener{fmt.Errorf("blob %s: %w", desc.Digest, err)}
	}
	return s.blob(repo, auth, desc)
}

// repository validates registry and repository and names them for
// go-containerregistry.
func (s *Source) repository(registry, repository string) (name.Repository, error) {
	registry = strings.ToLower(registry)
	if !ref.ValidRegistry(registry) || !ref.ValidRepository(repository) {
		return name.Repository{}, content.Permanent(fmt.Errorf("%w: %q/%q is not a registry and a repository", content.ErrInvalid, fetch.Truncate(registry), fetch.Truncate(repository)))
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

// transport returns the authenticated transport for repo and auth, and the
// scheme to reach the registry with. The registry's ping (how it wants
// clients to authenticate) is its own, made once per transportTTL for all
// its repositories (challenge); a repository of a registry that hands out
// bearer tokens costs its token, again when the token expires.
func (s *Source) transport(ctx context.Context, repo name.Repository, auth RegistryAuth) (http.RoundTripper, string, error) {
	key := repo.RegistryStr() + "/" + repo.RepositoryStr() + "\x00" + auth.Key()
	s.mu.Lock()
	ct, ok := s.transports[key]
	s.mu.Unlock()
	if ok && time.Now().Before(ct.expires) {
		return ct.rt, ct.scheme, nil
	}
	// One handshake per repository at a time: blobs opened together after
	// the transport expired share it.
	v, err, _ := s.handshakes.Do(key, func() (any, error) {
		authr, err := s.authenticator(auth, repo)
		if err != nil {
			return nil, content.Permanent(fmt.Errorf("looking up credentials for %s: %w", repo, err))
		}
		failed := func(err error) error {
			return fmt.Errorf("authenticating to %s: %w", repo.RegistryStr(), classifyRegistryErr(err))
		}
		base := transport.NewUserAgent(s.base, s.userAgent)
		pr, err := s.challenge(ctx, repo.Registry, base)
		if err != nil {
			return nil, failed(err)
		}
		ct := cachedTransport{scheme: "https", expires: time.Now().Add(transportTTL)}
		if pr.Insecure {
			ct.scheme = "http"
		}
		var tok *transport.Token
		if strings.EqualFold(pr.Scheme, "bearer") {
			if tok, err = transport.Exchange(ctx, repo.Registry, authr, base, []string{repo.Scope(transport.PullScope)}, pr); err != nil {
				return nil, failed(err)
			}
			// A token without a lifetime is good for 60 s (the distribution
			// token spec); a new one comes before it runs out.
			ct.expires = time.Now().Add(min(transportTTL, time.Duration(cmp.Or(tok.ExpiresIn, 60))*time.Second*9/10))
		}
		// For any other scheme FromToken attaches the credentials to each
		// request to the registry, as transport.NewWithContext does.
		if ct.rt, err = transport.FromToken(repo.Registry, authr, base, pr, tok); err != nil {
			return nil, failed(err)
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		evictExpired(s.transports, func(c cachedTransport) time.Time { return c.expires })
		s.transports[key] = ct
		return ct, nil
	})
	if err != nil {
		return nil, "", err
	}
	ct = v.(cachedTransport)
	return ct.rt, ct.scheme, nil
}

// challenge returns reg's answer to a ping (GET /v2/), asked through base
// at most transportTTL ago.
func (s *Source) challenge(ctx context.Context, reg name.Registry, base http.RoundTripper) (*transport.Challenge, error) {
	key := reg.Scheme() + "://" + reg.RegistryStr()
	s.mu.Lock()
	c, ok := s.challenges[key]
	s.mu.Unlock()
	if ok && time.Now().Before(c.expires) {
		return c.ch, nil
	}
	v, err, _ := s.handshakes.Do("ping\x00"+key, func() (any, error) {
		ch, err := transport.Ping(ctx, reg, base)
		if err != nil {
			return nil, err
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		evictExpired(s.challenges, func(c cachedChallenge) time.Time { return c.expires })
		s.challenges[key] = cachedChallenge{ch: ch, expires: time.Now().Add(transportTTL)}
		return ch, nil
	})
	if err != nil {
		return nil, err
	}
	return v.(*transport.Challenge), nil
}

// evictExpired makes room in m for one more entry: it drops the expired
// ones, and any others while m is full. s.mu must be held.
func evictExpired[V any](m map[string]V, expires func(V) time.Time) {
	if len(m) < maxTransports {
		return
	}
	now := time.Now()
	for k, v := range m {
		if !now.Before(expires(v)) || len(m) >= maxTransports {
			delete(m, k)
		}
	}
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
func (s *Source) do(ctx context.Context, repo name.Repository, auth RegistryAuth, method, what string, header func(http.Header)) (*http.Response, error) {
	rt, scheme, err := s.transport(ctx, repo, auth)
	if err != nil {
		return nil, err
	}
	u := &url.URL{Scheme: scheme, Host: repo.RegistryStr(), Path: "/v2/" + repo.RepositoryStr() + "/" + what}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), nil)
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("%s %s: %w", method, u, err))
	}
	if header != nil {
		header(req.Header)
	}
	client := &http.Client{Transport: rt, CheckRedirect: func(req *http.Request, via []*http.Request) error {
		if len(via) >= maxRedirects {
			return fmt.Errorf("stopped after %d redirects", maxRedirects)
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
func (s *Source) fetchManifest(ctx context.Context, repo name.Repository, auth RegistryAuth, reference string, want *content.Descriptor) (string, []byte, digest.Digest, error) {
	resp, err := s.do(ctx, repo, auth, http.MethodGet, "manifests/"+reference, func(h http.Header) {
		h.Set("Accept", manifestAccept)
	})
	if err != nil {
		return "", nil, "", err
	}
	defer fetch.DrainClose(resp.Body)
	where := "GET " + fetch.Redact(resp.Request.URL)
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
		return "", nil, "", fmt.Errorf("%w: %s: registry says %s, the bytes are %s", content.ErrDigestMismatch, where, fetch.Truncate(got), d)
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
	err := fetch.ResponseError(resp, resp.Request.URL)
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
		parts = append(parts, fetch.Truncate(strings.Trim(s, ": ")))
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
func (s *Source) blob(repo name.Repository, auth RegistryAuth, desc content.Descriptor) fetch.Blob {
	return fetch.Blob{Size: desc.Size, Fetch: func(ctx context.Context, off, end int64) (io.ReadCloser, error) {
		if err := content.ValidateDigest(desc.Digest); err != nil {
			return nil, content.Permanent(err)
		}
		resp, err := s.do(bulk(ctx), repo, auth, http.MethodGet, "blobs/"+desc.Digest.String(), fetch.RangeHeader(off, end, desc.Size, true))
		if err != nil {
			return nil, fmt.Errorf("blob %s: %w", desc.Digest, err)
		}
		if err := checkRegistryRange(resp, off, end, desc.Size); err != nil {
			fetch.DrainClose(resp.Body) // closed already after an unexpected status; closing again is harmless
			if se := (*fetch.StatusError)(nil); !errors.As(err, &se) {
				err = fmt.Errorf("GET %s: %w", fetch.Redact(resp.Request.URL), err)
			}
			return nil, fmt.Errorf("blob %s: %w", desc.Digest, err)
		}
		return resp.Body, nil
	}}
}

// checkRegistryRange is fetch.CheckRange for a registry: a 200 that ignored the
// range of a resumed read is refused, and other statuses are the registry's
// errors.
func checkRegistryRange(resp *http.Response, off, end, size int64) error {
	if resp.StatusCode == http.StatusOK && off != 0 {
		return content.Permanent(fmt.Errorf("%w: origin ignored Range and sent the whole blob; resuming from byte %d needs ranges", content.ErrInvalid, off))
	}
	err := fetch.CheckRange(resp, off, end, size)
	if errors.Is(err, fetch.ErrUnexpectedStatus) {
		return registryError(resp)
	}
	return err
}

// failedOpener fails every open with err.
type failedOpener struct{ err error }

func (f failedOpener) OpenRange(context.Context, int64) (io.ReadCloser, error) { return nil, f.err }
