package httpsource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// Source resolves ref.KindHTTP references: model manifests (see
// Manifest) and single files pinned by digest. Its blobs are read with
// ranged GETs.
//
// Either is laid out under the name of its URL (source.ModelName), never under
// a name the document gives: a manifest naming another model (a hub's, or
// another URL's) cannot put its files where that model's users load it.
//
// A manifest's snapshot is its revision when that is a commit (40 lowercase
// hex digits); any other revision is a branch or tag: the snapshot is then
// named by a commit-like id of the files (40 hex digits of the sha256 of
// their paths and digests), and the revision is written as a ref to it, so
// that new files behind the same branch make a new snapshot and move the
// ref, as a hub's branch does.
//
// A single-file reference becomes a one-file model whose revision is the
// first 12 hex digits of the digest and whose file keeps the last segment
// of the URL path as its name. So
// "https://example.com:8443/v1/llama/model.bin#sha256:0123456789ab…" is the
// model "example.com-8443/v1-llama-model.bin/<key>" at revision
// "0123456789ab" with the one file "model.bin". Its size is learned with a
// HEAD request, or with a GET of its first byte where HEAD is refused
// (presigned URLs are signed for one method) or reports no length.
type Source struct {
	client fetch.Client
}

// Option configures a Source.
type Option func(*Source)

// WithVersion sets the version sent in the User-Agent header
// ("weightd/<version>"); the default is "dev".
func WithVersion(version string) Option {
	return func(s *Source) { s.client.UserAgent = "weightd/" + version }
}

// New returns a source that makes its requests with client (nil:
// a client with no overall timeout over http.DefaultTransport; stalls are the
// cache's to detect). The client's redirect policy applies; the Range header
// survives redirects.
func New(client *http.Client, opts ...Option) *Source {
	if client == nil {
		client = &http.Client{Transport: http.DefaultTransport}
	}
	s := &Source{client: fetch.Client{HTTP: client, UserAgent: "weightd/dev"}}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Resolve fetches the manifest a reference names, or learns the size of the
// single file it pins, and returns the model with one ranged-GET opener per
// blob.
func (s *Source) Resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	if r.Kind != ref.KindHTTP || r.URL == nil {
		return nil, content.Permanent(fmt.Errorf("resolving %s: kind %q: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	var (
		res *source.Resolution
		err error
	)
	if r.Digest != "" {
		res, err = s.resolveFile(ctx, r)
	} else {
		res, err = s.resolveManifest(ctx, r.URL, source.ModelName(r))
	}
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", r.Redacted(), err)
	}
	return res, nil
}

func (s *Source) resolveManifest(ctx context.Context, u *url.URL, name string) (*source.Resolution, error) {
	resp, err := s.client.Do(ctx, http.MethodGet, u, func(h http.Header) { h.Set("Accept", "application/json") })
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fetch.ResponseError(resp, u)
	}
	if resp.ContentLength > MaxManifestSize {
		return nil, content.Permanent(fmt.Errorf("%w: manifest of %d bytes is larger than %d", content.ErrInvalid, resp.ContentLength, MaxManifestSize))
	}
	m, err := ReadManifest(resp.Body)
	if err != nil {
		if errors.Is(err, content.ErrInvalid) {
			return nil, content.Permanent(err)
		}
		return nil, err
	}
	res := &source.Resolution{Model: m.Layout(name), Blobs: make(map[digest.Digest]content.RangeOpener, len(m.Files))}
	for _, f := range m.Files {
		fu, err := f.fileURL(u)
		if err != nil {
			return nil, content.Permanent(err)
		}
		if _, ok := res.Blobs[f.Digest()]; !ok {
			res.Blobs[f.Digest()] = s.blob(fu, f.Size)
		}
	}
	return res, nil
}

func (s *Source) resolveFile(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	size, err := s.size(ctx, r.URL)
	if err != nil {
		return nil, err
	}
	m := source.SingleFileModel(r.URL, r.Digest, size)
	if err := m.Validate(); err != nil {
		return nil, content.Permanent(err)
	}
	return &source.Resolution{
		Model: m,
		Blobs: map[digest.Digest]content.RangeOpener{r.Digest: s.blob(r.URL, size)},
	}, nil
}

// size learns a file's size with HEAD, falling back to a GET of its first
// byte when HEAD is refused or reports no Content-Length.
func (s *Source) size(ctx context.Context, u *url.URL) (int64, error) {
	resp, err := s.client.Do(ctx, http.MethodHead, u, nil)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		if resp.ContentLength >= 0 {
			return resp.ContentLength, nil
		}
	case http.StatusForbidden, http.StatusMethodNotAllowed, http.StatusNotImplemented:
	default:
		return 0, fetch.ResponseError(resp, u)
	}

	resp, err = s.client.Do(ctx, http.MethodGet, u, func(h http.Header) {
		h.Set("Range", "bytes=0-0")
		h.Set("Accept-Encoding", "identity")
	})
	if err != nil {
		return 0, err
	}
	defer fetch.DrainClose(resp.Body)
	switch resp.StatusCode {
	case http.StatusPartialContent:
		_, _, total, err := fetch.ParseContentRange(resp.Header.Get("Content-Range"))
		if err != nil || total < 0 {
			return 0, content.Permanent(fmt.Errorf("%w: GET %s: Content-Range %q: want a known total", content.ErrInvalid, fetch.Redact(u), resp.Header.Get("Content-Range")))
		}
		return total, nil
	case http.StatusOK:
		if resp.ContentLength < 0 {
			return 0, content.Permanent(fmt.Errorf("%w: GET %s: no Content-Length", content.ErrInvalid, fetch.Redact(u)))
		}
		return resp.ContentLength, nil
	case http.StatusRequestedRangeNotSatisfiable:
		return 0, nil // the only file with no first byte is the empty one
	default:
		return 0, fetch.ResponseError(resp, u)
	}
}

// blob reads the blob at u with ranged GETs. A 206 must carry
// "Content-Range: bytes off-(end-1)/size"; a total other than the expected
// size is a permanent content.ErrSizeMismatch. A 200 (a server that ignores
// Range) must have the expected Content-Length when it has one, and its
// first off bytes are read and discarded before the body is returned, so
// resuming works, slowly, even there (the cache's stall timeout bounds how
// long that may take).
func (s *Source) blob(u *url.URL, size int64) fetch.Blob {
	return fetch.Blob{Size: size, Fetch: func(ctx context.Context, off, end int64) (io.ReadCloser, error) {
		resp, err := s.client.Do(ctx, http.MethodGet, u, fetch.RangeHeader(off, end, size, false))
		if err != nil {
			return nil, err
		}
		if err := fetch.CheckRange(resp, off, end, size); err != nil {
			if errors.Is(err, fetch.ErrUnexpectedStatus) {
				err = fetch.ResponseError(resp, u)
			}
			fetch.DrainClose(resp.Body)
			return nil, fmt.Errorf("GET %s: %w", fetch.Redact(u), err)
		}
		if resp.StatusCode == http.StatusOK && off > 0 {
			if _, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
				resp.Body.Close()
				return nil, fmt.Errorf("GET %s: skipping %d bytes of a response that ignored Range: %w", fetch.Redact(u), off, err)
			}
		}
		// Bytes past the blob's end are left for the cache to notice (a
		// permanent size mismatch), not hidden.
		return resp.Body, nil
	}}
}
