package prefetch

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
)

// HTTPSource resolves ref.KindHTTP references: model manifests (see
// Manifest) and single files pinned by digest. Its blobs are read with
// ranged GETs.
//
// Either is laid out under the name of its URL (ModelName), never under
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
type HTTPSource struct {
	client    *http.Client
	userAgent string
}

// HTTPOption configures an HTTPSource.
type HTTPOption func(*HTTPSource)

// WithVersion sets the version sent in the User-Agent header
// ("weightd/<version>"); the default is "dev".
func WithVersion(version string) HTTPOption {
	return func(s *HTTPSource) { s.userAgent = "weightd/" + version }
}

// NewHTTPSource returns a source that makes its requests with client (nil:
// a client with no overall timeout over http.DefaultTransport; stalls are the
// cache's to detect). The client's redirect policy applies; the Range header
// survives redirects.
func NewHTTPSource(client *http.Client, opts ...HTTPOption) *HTTPSource {
	if client == nil {
		client = &http.Client{Transport: http.DefaultTransport}
	}
	s := &HTTPSource{client: client, userAgent: "weightd/dev"}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Resolve fetches the manifest a reference names, or learns the size of the
// single file it pins, and returns the model with one ranged-GET opener per
// blob.
func (s *HTTPSource) Resolve(ctx context.Context, r ref.Ref) (*Resolution, error) {
	if r.Kind != ref.KindHTTP || r.URL == nil {
		return nil, content.Permanent(fmt.Errorf("resolving %s: kind %q: %w", r.Redacted(), r.Kind, errors.ErrUnsupported))
	}
	var (
		res *Resolution
		err error
	)
	if r.Digest != "" {
		res, err = s.resolveFile(ctx, r)
	} else {
		res, err = s.resolveManifest(ctx, r.URL)
	}
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", r.Redacted(), err)
	}
	return res, nil
}

func (s *HTTPSource) resolveManifest(ctx context.Context, u *url.URL) (*Resolution, error) {
	resp, err := s.do(ctx, http.MethodGet, u, func(h http.Header) { h.Set("Accept", "application/json") })
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, statusError(resp, u)
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
	res := &Resolution{Model: m.layout(u), Blobs: make(map[digest.Digest]content.RangeOpener, len(m.Files))}
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

func (s *HTTPSource) resolveFile(ctx context.Context, r ref.Ref) (*Resolution, error) {
	size, err := s.size(ctx, r.URL)
	if err != nil {
		return nil, err
	}
	m := singleFileModel(r.URL, r.Digest, size)
	if err := m.Validate(); err != nil {
		return nil, content.Permanent(err)
	}
	return &Resolution{
		Model: m,
		Blobs: map[digest.Digest]content.RangeOpener{r.Digest: s.blob(r.URL, size)},
	}, nil
}

// size learns a file's size with HEAD, falling back to a GET of its first
// byte when HEAD is refused or reports no Content-Length.
func (s *HTTPSource) size(ctx context.Context, u *url.URL) (int64, error) {
	resp, err := s.do(ctx, http.MethodHead, u, nil)
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
		return 0, statusError(resp, u)
	}

	resp, err = s.do(ctx, http.MethodGet, u, func(h http.Header) {
		h.Set("Range", "bytes=0-0")
		h.Set("Accept-Encoding", "identity")
	})
	if err != nil {
		return 0, err
	}
	defer drainClose(resp.Body)
	switch resp.StatusCode {
	case http.StatusPartialContent:
		_, _, total, err := parseContentRange(resp.Header.Get("Content-Range"))
		if err != nil || total < 0 {
			return 0, content.Permanent(fmt.Errorf("%w: GET %s: Content-Range %q: want a known total", content.ErrInvalid, redact(u), resp.Header.Get("Content-Range")))
		}
		return total, nil
	case http.StatusOK:
		if resp.ContentLength < 0 {
			return 0, content.Permanent(fmt.Errorf("%w: GET %s: no Content-Length", content.ErrInvalid, redact(u)))
		}
		return resp.ContentLength, nil
	case http.StatusRequestedRangeNotSatisfiable:
		return 0, nil // the only file with no first byte is the empty one
	default:
		return 0, statusError(resp, u)
	}
}

func (s *HTTPSource) do(ctx context.Context, method string, u *url.URL, header func(http.Header)) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, u.String(), nil)
	if err != nil {
		return nil, content.Permanent(fmt.Errorf("%s %s: %w", method, redact(u), err))
	}
	req.Header.Set("User-Agent", s.userAgent)
	if header != nil {
		header(req.Header)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		// url.Error repeats the URL, query and all.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("%s %s: %w", method, redact(u), err)
	}
	return resp, nil
}

// rangedBlob is a blob of a known size read with ranged requests: the bounds
// checks and bounded reads every source shares. fetch makes one request for
// bytes [off, end), off < end, and returns the body from off.
type rangedBlob struct {
	size  int64
	fetch func(ctx context.Context, off, end int64) (io.ReadCloser, error)
}

// OpenRange reads the blob from off to its end.
func (b rangedBlob) OpenRange(ctx context.Context, off int64) (io.ReadCloser, error) {
	return b.openRange(ctx, off, b.size)
}

// OpenBoundedRange reads bytes [off, off+n) of the blob, so that a chunk
// from the origin costs the origin exactly its bytes (the swarm reads chunks
// this way). The reader ends after n bytes.
func (b rangedBlob) OpenBoundedRange(ctx context.Context, off, n int64) (io.ReadCloser, error) {
	if n < 0 || off < 0 || n > b.size-off {
		return nil, content.Permanent(fmt.Errorf("%w: bytes %d+%d outside a blob of %d bytes", content.ErrInvalid, off, n, b.size))
	}
	body, err := b.openRange(ctx, off, off+n)
	if err != nil {
		return nil, err
	}
	return struct {
		io.Reader
		io.Closer
	}{io.LimitReader(body, n), body}, nil
}

func (b rangedBlob) openRange(ctx context.Context, off, end int64) (io.ReadCloser, error) {
	if off < 0 || off > b.size {
		return nil, content.Permanent(fmt.Errorf("%w: offset %d outside a blob of %d bytes", content.ErrInvalid, off, b.size))
	}
	if off == end {
		return http.NoBody, nil
	}
	return b.fetch(ctx, off, end)
}

// rangeHeader is the Range header for bytes [off, end) of a blob of size
// bytes: open-ended when end is the blob's end, unless closed is set (some
// registries do not understand "bytes=off-").
func rangeHeader(off, end, size int64, closed bool) func(http.Header) {
	return func(h http.Header) {
		spec := "bytes=" + strconv.FormatInt(off, 10) + "-"
		if end < size || closed {
			spec += strconv.FormatInt(end-1, 10)
		}
		h.Set("Range", spec)
		h.Set("Accept-Encoding", "identity")
	}
}

// blob reads the blob at u with ranged GETs. A 206 must carry
// "Content-Range: bytes off-(end-1)/size"; a total other than the expected
// size is a permanent content.ErrSizeMismatch. A 200 (a server that ignores
// Range) must have the expected Content-Length when it has one, and its
// first off bytes are read and discarded before the body is returned, so
// resuming works, slowly, even there (the cache's stall timeout bounds how
// long that may take).
func (s *HTTPSource) blob(u *url.URL, size int64) rangedBlob {
	return rangedBlob{size: size, fetch: func(ctx context.Context, off, end int64) (io.ReadCloser, error) {
		resp, err := s.do(ctx, http.MethodGet, u, rangeHeader(off, end, size, false))
		if err != nil {
			return nil, err
		}
		if err := checkRange(resp, off, end, size); err != nil {
			if errors.Is(err, errUnexpectedStatus) {
				err = statusError(resp, u)
			}
			drainClose(resp.Body)
			return nil, fmt.Errorf("GET %s: %w", redact(u), err)
		}
		if resp.StatusCode == http.StatusOK && off > 0 {
			if _, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
				resp.Body.Close()
				return nil, fmt.Errorf("GET %s: skipping %d bytes of a response that ignored Range: %w", redact(u), off, err)
			}
		}
		// Bytes past the blob's end are left for the cache to notice (a
		// permanent size mismatch), not hidden.
		return resp.Body, nil
	}}
}

// errUnexpectedStatus is checkRange's answer to a status it does not know:
// the source names the error.
var errUnexpectedStatus = errors.New("unexpected status")

// checkRange checks a response to a GET of bytes [off, end) of a blob of
// size bytes: a 206 whose Content-Range is exactly that, a 200 with the
// whole blob, or a 416 (a permanent size mismatch). Any other status is
// errUnexpectedStatus.
func checkRange(resp *http.Response, off, end, size int64) error {
	switch resp.StatusCode {
	case http.StatusPartialContent:
		cr := resp.Header.Get("Content-Range")
		first, last, total, err := parseContentRange(cr)
		switch {
		case err != nil:
			return fmt.Errorf("Content-Range %q: %w", truncate(cr), err)
		case total >= 0 && total != size:
			return content.Permanent(fmt.Errorf("%w: origin has %d bytes, want %d", content.ErrSizeMismatch, total, size))
		case first != off || last != end-1:
			return fmt.Errorf("Content-Range %q: want bytes %d-%d/%d", truncate(cr), off, end-1, size)
		case resp.ContentLength >= 0 && resp.ContentLength != last-first+1:
			return fmt.Errorf("Content-Length %d disagrees with Content-Range %q", resp.ContentLength, truncate(cr))
		}
		return nil
	case http.StatusOK:
		if resp.ContentLength >= 0 && resp.ContentLength != size {
			return content.Permanent(fmt.Errorf("%w: origin has %d bytes, want %d", content.ErrSizeMismatch, resp.ContentLength, size))
		}
		return nil
	case http.StatusRequestedRangeNotSatisfiable:
		return content.Permanent(fmt.Errorf("%w: origin refuses bytes %d- of a blob of %d bytes: HTTP %s", content.ErrSizeMismatch, off, size, resp.Status))
	default:
		return errUnexpectedStatus
	}
}

// parseContentRange parses "bytes first-last/total"; total is -1 for "*".
func parseContentRange(s string) (first, last, total int64, err error) {
	spec, ok := strings.CutPrefix(s, "bytes ")
	if !ok {
		return 0, 0, 0, errors.New("not a byte range")
	}
	rng, tot, ok := strings.Cut(spec, "/")
	if !ok {
		return 0, 0, 0, errors.New("no total")
	}
	a, z, ok := strings.Cut(rng, "-")
	if !ok {
		return 0, 0, 0, errors.New("no range")
	}
	if first, err = parseNonNegative(a); err != nil {
		return 0, 0, 0, err
	}
	if last, err = parseNonNegative(z); err != nil {
		return 0, 0, 0, err
	}
	total = -1
	if tot != "*" {
		if total, err = parseNonNegative(tot); err != nil {
			return 0, 0, 0, err
		}
	}
	if last < first || (total >= 0 && last >= total) {
		return 0, 0, 0, errors.New("range out of order")
	}
	return first, last, total, nil
}

func parseNonNegative(s string) (int64, error) {
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a number", truncate(s))
	}
	return strconv.ParseInt(s, 10, 64)
}

// StatusError is an HTTP response status the source did not expect. It is
// wrapped with content.Permanent for statuses retrying cannot fix: 4xx other
// than 408, 425 and 429.
type StatusError struct {
	Method     string
	URL        string // redacted: no query
	StatusCode int
	Status     string
}

// Error says which request got which status.
func (e *StatusError) Error() string {
	return fmt.Sprintf("%s %s: HTTP %s", e.Method, e.URL, e.Status)
}

func statusError(resp *http.Response, u *url.URL) error {
	drainClose(resp.Body)
	err := &StatusError{Method: resp.Request.Method, URL: redact(u), StatusCode: resp.StatusCode, Status: resp.Status}
	switch c := resp.StatusCode; {
	case c == http.StatusRequestTimeout, c == http.StatusTooEarly, c == http.StatusTooManyRequests:
		return err
	case c >= 400 && c < 500:
		return content.Permanent(err)
	default:
		return err
	}
}

// drainClose reads a little of an unwanted body so the connection can be
// reused, and closes it.
func drainClose(body io.ReadCloser) {
	_, _ = io.CopyN(io.Discard, body, 4<<10)
	body.Close()
}

// redact drops the query (credentials in presigned URLs) from u for messages.
func redact(u *url.URL) string {
	if u.RawQuery == "" {
		return u.String()
	}
	c := *u
	c.RawQuery = "REDACTED"
	return c.String()
}

// urlModelName is the name of the model a URL names (ModelName):
// "<host>/<path>/<key>", three parts where hubs' names have at most two, so
// that no hub model is ever laid out in its place. Host (and "-<port>") and
// path are sanitised for people to read, which loses bytes ('/' and ':'
// become '-'); key, the first 16 hex digits of the sha256 of the URL's
// scheme, host, port and escaped path, tells URLs apart, so that no other
// URL's model is laid out in its place either. The query (presigned URLs'
// credentials) and fragment are no part of it.
func urlModelName(u *url.URL) string {
	host := sanitize(u.Host, 96, "host")
	name := sanitize(strings.TrimPrefix(u.Path, "/"), 96, "file")
	sum := sha256.Sum256([]byte(u.Scheme + "://" + strings.ToLower(u.Host) + u.EscapedPath()))
	return host + "/" + name + "/" + hex.EncodeToString(sum[:8])
}

// singleFileModel names the one-file model of a digest-pinned URL; see
// HTTPSource.
func singleFileModel(u *url.URL, d digest.Digest, size int64) content.Model {
	file := sanitize(path.Base(u.Path), 255, "blob")
	return content.Model{
		Name:     urlModelName(u),
		Revision: d.Encoded()[:12],
		Files:    []content.File{{Path: file, Descriptor: content.Descriptor{Digest: d, Size: size}}},
	}
}

// sanitize maps s to a valid model name segment or file name of at most max
// bytes: letters, digits, '.', '_' and '-', runs of anything else (and of
// '-') as one '-', starting with a letter or digit and ending with neither
// '.' nor '-'. An empty result becomes fallback.
func sanitize(s string, max int, fallback string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_'
		switch {
		case ok:
			b.WriteByte(c)
		case b.Len() > 0 && !strings.HasSuffix(b.String(), "-"):
			b.WriteByte('-')
		}
	}
	out := strings.TrimLeft(b.String(), "._-")
	if len(out) > max {
		out = out[:max]
	}
	out = strings.TrimRight(out, ".-")
	if out == "" {
		return fallback
	}
	return out
}
