package mirror

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"slices"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/oci"
)

// maxManifest bounds a manifest's size: manifests are read into memory.
const maxManifest = 4 << 20

// Manifest media types the mirror recognises when a manifest does not say.
const (
	mediaTypeOCIManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaTypeOCIIndex    = "application/vnd.oci.image.index.v1+json"
	// mediaTypeDockerManifest is an index's entry for a Docker image.
	mediaTypeDockerManifest = "application/vnd.docker.distribution.manifest.v2+json"
)

// mediaTypeRE is what a media type must look like to become a header.
var mediaTypeRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}$`)

// errNotManifest: a blob in the cache that is not a manifest.
var errNotManifest = errors.New("not a manifest")

// manifestJSON is the part of an image manifest, an index or an artifact
// manifest that the mirror reads: its media type and the descriptors of its
// children.
type manifestJSON struct {
	SchemaVersion int              `json:"schemaVersion"`
	MediaType     string           `json:"mediaType"`
	Config        *descriptorJSON  `json:"config"`
	Layers        []descriptorJSON `json:"layers"`
	Manifests     []descriptorJSON `json:"manifests"`
	Blobs         []descriptorJSON `json:"blobs"`
}

type descriptorJSON struct {
	MediaType string        `json:"mediaType"`
	Digest    digest.Digest `json:"digest"`
	Size      int64         `json:"size"`
}

// parseManifest reads a manifest's own media type (empty when it has none)
// and its children.
func parseManifest(body []byte) (mediaType string, children []descriptorJSON, err error) {
	var mf manifestJSON
	if err := json.Unmarshal(body, &mf); err != nil {
		return "", nil, fmt.Errorf("%w: %v", errNotManifest, err)
	}
	if mf.SchemaVersion == 0 {
		return "", nil, fmt.Errorf("%w: no schemaVersion", errNotManifest)
	}
	if mf.Config != nil {
		children = append(children, *mf.Config)
	}
	children = append(children, mf.Layers...)
	children = append(children, mf.Manifests...)
	children = append(children, mf.Blobs...)
	mediaType = mf.MediaType
	if !mediaTypeRE.MatchString(mediaType) {
		switch {
		case mf.Manifests != nil:
			mediaType = mediaTypeOCIIndex
		case mf.Config != nil:
			mediaType = mediaTypeOCIManifest
		default:
			mediaType = ""
		}
	}
	return mediaType, children, nil
}

func (m *Mirror) serveManifest(w http.ResponseWriter, r *http.Request, registry string, rt route) {
	if rt.tag != "" {
		m.manifestByTag(w, r, registry, rt)
		return
	}
	m.manifestByDigest(w, r, registry, rt)
}

// manifestByTag asks the upstream (tags move), stores the manifest and
// remembers the tag. A registry that refuses the client is its answer; when
// the upstream fails otherwise (but "no such manifest"), the tag's last
// known manifest is served from the cache if it is public or the registry
// let this client have it moments ago, else the client is refused.
func (m *Mirror) manifestByTag(w http.ResponseWriter, r *http.Request, registry string, rt route) {
	key := tagKey(registry, rt.repository, rt.tag)
	auth := m.requestAuth(r, registry)
	mt, body, d, err := m.upstreamManifest(r.Context(), auth, registry, rt.repository, rt.tag, "")
	if err == nil {
		m.allowed(auth, registry, rt.repository, d)
		if err := m.storeManifest(r.Context(), d, body); err != nil {
			m.log.Warn("storing a manifest in the cache", "registry", registry, "repository", rt.repository, "tag", rt.tag, "err", err)
		} else if err := m.tags.put(key, tagEntry{Digest: d, MediaType: mt, Updated: time.Now(), Public: m.public.has(d)}); err != nil {
			m.log.Warn("saving a tag", "registry", registry, "repository", rt.repository, "tag", rt.tag, "err", err)
		}
		m.m.request(routeManifest, outcomeMiss)
		m.writeManifest(w, r, auth, registry, rt.repository, d, mt, body, "fetch")
		return
	}
	if errors.Is(err, content.ErrNotFound) || errors.Is(err, content.ErrDenied) {
		aerr := m.upstreamErr(err, auth, registry, rt.repository, errManifestUnknown)
		m.m.request(routeManifest, outcomeOf(aerr))
		aerr.write(w, r)
		return
	}
	if r.Context().Err() != nil {
		return // the client is gone
	}
	e, ok := m.tags.get(key)
	switch {
	case !ok:
		m.log.Warn("upstream failed for a tag never seen", "registry", registry, "repository", rt.repository, "tag", rt.tag, "err", err)
	case !e.Public && !m.public.has(e.Digest) && !m.grants.has(grantKey(auth, registry, rt.repository, e.Digest)):
		m.log.Warn("upstream failed and the tag's last known manifest is private: not serving it unconfirmed", "registry", registry,
			"repository", rt.repository, "tag", rt.tag, "digest", e.Digest, "err", err)
	default:
		body, mt, cerr := m.cachedManifest(e.Digest)
		if cerr == nil {
			if mediaTypeRE.MatchString(e.MediaType) {
				mt = e.MediaType
			}
			if e.Public {
				m.publishChildren(e.Digest, body)
			}
			m.log.Info("upstream failed; serving the tag's last known manifest", "registry", registry,
				"repository", rt.repository, "tag", rt.tag, "digest", e.Digest, "since", e.Updated, "err", err)
			m.m.request(routeManifest, outcomeFallback)
			m.writeManifest(w, r, auth, registry, rt.repository, e.Digest, mt, body, "cache")
			return
		}
		m.log.Warn("upstream failed and the tag's last known manifest is not in the cache", "registry", registry,
			"repository", rt.repository, "tag", rt.tag, "digest", e.Digest, "err", err, "cacheErr", cerr)
	}
	m.m.request(routeManifest, outcomeError)
	errUnavailable.write(w, r)
}

// publishChildren marks the manifest d of a public tag, and what it names,
// public: the registry gave it without credentials, and a registry keeps
// the blobs of a manifest in its repository. An index's manifests in the
// cache have theirs marked too. Only the outage fallback does this, so that
// a restarted agent still serves a public image's layers while the
// registry is down.
func (m *Mirror) publishChildren(d digest.Digest, body []byte) {
	m.public.add(d)
	_, children, err := parseManifest(body)
	if err != nil {
		return
	}
	for _, c := range children {
		if content.ValidateDigest(c.Digest) != nil {
			continue
		}
		m.public.add(c.Digest)
		if c.MediaType != mediaTypeOCIManifest && c.MediaType != mediaTypeDockerManifest {
			continue
		}
		if cb, _, err := m.cachedManifest(c.Digest); err == nil {
			if _, grand, err := parseManifest(cb); err == nil {
				for _, g := range grand {
					if content.ValidateDigest(g.Digest) == nil {
						m.public.add(g.Digest)
					}
				}
			}
		}
	}
}

// manifestByDigest serves a manifest from the cache to a client the
// registry lets have it, or else fetches it upstream, checks it against its
// digest and stores it.
func (m *Mirror) manifestByDigest(w http.ResponseWriter, r *http.Request, registry string, rt route) {
	auth := m.requestAuth(r, registry)
	body, mt, err := m.cachedManifest(rt.digest)
	switch {
	case err == nil:
		if aerr := m.authorize(r.Context(), auth, registry, rt.repository, rt.digest, true); aerr != nil {
			m.m.request(routeManifest, outcomeOf(aerr))
			if r.Context().Err() == nil {
				aerr.write(w, r)
			}
			return
		}
		m.m.request(routeManifest, outcomeHit)
		m.writeManifest(w, r, auth, registry, rt.repository, rt.digest, mt, body, "cache")
		return
	case errors.Is(err, errNotManifest):
		m.m.request(routeManifest, outcomeNotFound)
		errManifestUnknown.write(w, r)
		return
	case !errors.Is(err, content.ErrNotFound):
		m.log.Warn("reading a manifest from the cache", "digest", rt.digest, "err", err)
	}
	mt, body, _, err = m.upstreamManifest(r.Context(), auth, registry, rt.repository, rt.digest.String(), rt.digest)
	if err != nil {
		aerr := m.upstreamErr(err, auth, registry, rt.repository, errManifestUnknown)
		if aerr == errUnavailable && r.Context().Err() == nil {
			m.log.Warn("fetching a manifest upstream", "registry", registry, "repository", rt.repository, "digest", rt.digest, "err", err)
		}
		m.m.request(routeManifest, outcomeOf(aerr))
		aerr.write(w, r)
		return
	}
	m.allowed(auth, registry, rt.repository, rt.digest)
	if err := m.storeManifest(r.Context(), rt.digest, body); err != nil {
		m.log.Warn("storing a manifest in the cache", "digest", rt.digest, "err", err)
	}
	m.m.request(routeManifest, outcomeMiss)
	m.writeManifest(w, r, auth, registry, rt.repository, rt.digest, mt, body, "fetch")
}

// upstreamManifest fetches a manifest upstream and checks it: its size, its
// digest (against want where it is set, and against what the upstream
// says), and its media type. It remembers the manifest's children.
func (m *Mirror) upstreamManifest(ctx context.Context, auth oci.RegistryAuth, registry, repository, reference string, want digest.Digest) (string, []byte, digest.Digest, error) {
	ctx, cancel := context.WithTimeout(ctx, m.opts.manifestTimeout)
	defer cancel()
	mt, body, said, err := m.upstream.Manifest(ctx, auth, registry, repository, reference)
	if err != nil {
		return "", nil, "", err
	}
	if len(body) > maxManifest {
		return "", nil, "", fmt.Errorf("upstream manifest is %d bytes, more than %d", len(body), maxManifest)
	}
	d := digest.FromBytes(body)
	if want != "" && d != want {
		return "", nil, "", fmt.Errorf("%w: upstream sent manifest %s for %s", content.ErrDigestMismatch, d, want)
	}
	if said != "" && said != d {
		return "", nil, "", fmt.Errorf("%w: upstream said manifest %s, its bytes are %s", content.ErrDigestMismatch, said, d)
	}
	own, children, perr := parseManifest(body)
	if perr != nil {
		return "", nil, "", fmt.Errorf("upstream manifest %s: %w", d, perr)
	}
	if !mediaTypeRE.MatchString(mt) {
		mt = own
	}
	if mt == "" {
		return "", nil, "", fmt.Errorf("upstream manifest %s: unknown media type", d)
	}
	m.remember(d, int64(len(body)), mt, children)
	return mt, body, d, nil
}

// Learn records that tag names the manifest or index d, as a prefetch that
// resolved the tag learned it, so that a pull of the tag through the mirror
// is served even while the upstream is down, if the image is public (the
// prefetch fetched it without credentials; see source.Image.Public). The
// manifest must be in the cache already (a prefetched image's is). Tags of
// registries the mirror does not serve are ignored.
func (m *Mirror) Learn(registry, repository, tag string, d digest.Digest, public bool) error {
	h, ok := canonicalHost(registry)
	if !ok || !slices.Contains(m.opts.registries, h) {
		return nil
	}
	_, mt, err := m.cachedManifest(d)
	if err != nil {
		return fmt.Errorf("learning %s/%s:%s: %w", registry, repository, tag, err)
	}
	return m.tags.put(tagKey(h, repository, tag), tagEntry{Digest: d, MediaType: mt, Updated: time.Now(), Public: public})
}

// remember records a manifest's size and media type and its children's, so
// that requests for them know their sizes without asking the upstream.
func (m *Mirror) remember(d digest.Digest, size int64, mediaType string, children []descriptorJSON) {
	m.known.put(d, knownBlob{Size: size, MediaType: mediaType})
	for _, c := range children {
		if content.ValidateDigest(c.Digest) != nil || c.Size < 0 {
			continue
		}
		mt := c.MediaType
		if !mediaTypeRE.MatchString(mt) {
			mt = ""
		}
		m.known.put(c.Digest, knownBlob{Size: c.Size, MediaType: mt})
	}
}

// storeManifest puts a verified manifest into the cache as a blob.
func (m *Mirror) storeManifest(ctx context.Context, d digest.Digest, body []byte) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.opts.manifestTimeout)
	defer cancel()
	_, err := m.store.Fetch(ctx, content.Descriptor{Digest: d, Size: int64(len(body))}, cache.Bytes(body), nil)
	return err
}

// cachedManifest reads a manifest from the cache with its media type.
// content.ErrNotFound when the cache does not hold it, errNotManifest when
// the blob is not a manifest.
func (m *Mirror) cachedManifest(d digest.Digest) ([]byte, string, error) {
	info, err := m.store.Stat(d)
	if err != nil {
		return nil, "", err
	}
	if info.Size > maxManifest {
		return nil, "", fmt.Errorf("%w: %d bytes", errNotManifest, info.Size)
	}
	f, err := m.store.Open(d)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	body, err := io.ReadAll(io.LimitReader(f, maxManifest+1))
	if err != nil {
		return nil, "", fmt.Errorf("reading manifest %s: %w", d, err)
	}
	if int64(len(body)) != info.Size {
		return nil, "", fmt.Errorf("reading manifest %s: %d bytes, want %d", d, len(body), info.Size)
	}
	own, children, err := parseManifest(body)
	if err != nil {
		return nil, "", err
	}
	mt := own
	if k, ok := m.known.get(d); ok && k.MediaType != "" {
		mt = k.MediaType
	}
	if mt == "" {
		return nil, "", fmt.Errorf("%w: unknown media type", errNotManifest)
	}
	m.remember(d, info.Size, mt, children)
	return body, mt, nil
}

// writeManifest sends a manifest (GET) or its headers (HEAD), with Range and
// conditional requests handled by http.ServeContent. A GET of an image
// manifest starts the fetches of its config and layers.
func (m *Mirror) writeManifest(w http.ResponseWriter, r *http.Request, auth oci.RegistryAuth, registry, repository string, d digest.Digest, mediaType string, body []byte, source string) {
	if r.Method == http.MethodGet && m.opts.prefetchLayers {
		m.prefetchLayers(auth, registry, repository, body)
	}
	h := w.Header()
	h.Set("Content-Type", mediaType)
	h.Set("Docker-Content-Digest", d.String())
	h.Set("ETag", `"`+d.String()+`"`)
	cw := &countingWriter{ResponseWriter: w}
	http.ServeContent(cw, r, "", time.Time{}, bytes.NewReader(body))
	m.m.bytes.WithLabelValues(source).Add(float64(cw.n))
}

// prefetchLayers starts the fetch of each blob of an image manifest that
// the cache lacks: containerd fetches at most three layers at a time
// (max_concurrent_downloads), and a layer it asks for late would start
// through the swarm late, where all of them can cross the cluster at once.
// An index's manifests are left alone: only one platform's is wanted. They
// are fetched with the credentials the manifest was served for.
func (m *Mirror) prefetchLayers(auth oci.RegistryAuth, registry, repository string, body []byte) {
	var mf manifestJSON
	if json.Unmarshal(body, &mf) != nil || mf.Config == nil {
		return
	}
	for _, c := range append([]descriptorJSON{*mf.Config}, mf.Layers...) {
		desc := content.Descriptor{Digest: c.Digest, Size: c.Size}
		if desc.Validate() != nil {
			continue
		}
		if _, err := m.store.Stat(desc.Digest); err == nil {
			continue
		}
		if _, err := m.download(auth, registry, repository, desc); err != nil {
			m.log.Debug("not prefetching a layer", "digest", desc.Digest, "err", err)
		}
	}
}

// countingWriter counts the body bytes written, keeping the ReaderFrom of
// the connection so that files still go out with sendfile.
type countingWriter struct {
	http.ResponseWriter
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.n += int64(n)
	return n, err
}

func (c *countingWriter) ReadFrom(r io.Reader) (int64, error) {
	if rf, ok := c.ResponseWriter.(io.ReaderFrom); ok {
		n, err := rf.ReadFrom(r)
		c.n += n
		return n, err
	}
	return io.Copy(writerOnly{c}, r)
}

// Unwrap lets http.ResponseController reach the connection (Flush).
func (c *countingWriter) Unwrap() http.ResponseWriter { return c.ResponseWriter }

type writerOnly struct{ io.Writer }
