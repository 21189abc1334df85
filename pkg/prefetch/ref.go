package prefetch

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
)

// MaxRefLength is the longest reference ParseRef accepts, in bytes.
const MaxRefLength = 4096

// Kind says which family of source a reference belongs to.
type Kind string

// Reference kinds.
const (
	// KindHTTP is a plain http:// or https:// URL: a model manifest, or one
	// file pinned by digest.
	KindHTTP Kind = "http"
	// KindOCI is an image or a ModelPack model artifact in an OCI registry:
	// oci://registry[:port]/repository[:tag][@sha256:…].
	KindOCI Kind = "oci"
	// KindHF is a model repository on a Hugging Face style hub:
	// hf://[org/]name[@revision].
	KindHF Kind = "hf"
	// KindS3 is a model under a prefix of an S3 (or S3-compatible) bucket:
	// s3://bucket[/prefix][@version] or one object pinned by digest,
	// s3://bucket/key#sha256:….
	KindS3 Kind = "s3"
)

// Ref is a parsed, validated model reference. Which fields are set depends on
// Kind.
//
// For KindHTTP, URL is the absolute http(s) URL without its fragment, and
// Digest is set when the reference names a single file pinned by digest
// ("https://host/file.bin#sha256:…"); otherwise URL names a model manifest.
//
// For KindOCI, Registry is the registry host (lower-cased, with its port if
// given), Repository the repository path, Tag the tag ("latest" when neither
// a tag nor a digest is given) and Digest the manifest or index digest when
// pinned; with both, the digest wins and the tag is kept as a name.
//
// For KindHF, Repository is "org/name" (or a bare "name"), Revision the
// branch, tag or commit ("main" when not given).
//
// For KindS3, URL is "s3://bucket/prefix" (Host the bucket, Path "/" and the
// prefix without a trailing '/', or empty for the whole bucket), Revision
// the S3 version id of the prefix's model.json when pinned by "@version",
// and Digest the digest of the one object Path names when pinned by
// "#sha256:…" (see S3Source).
type Ref struct {
	Kind       Kind
	URL        *url.URL
	Digest     digest.Digest
	Registry   string
	Repository string
	Tag        string
	Revision   string
}

// ParseRef parses and validates a model reference.
//
// An HTTP reference must be an absolute http or https URL of at most
// MaxRefLength bytes, of printable ASCII only (no whitespace or control
// characters; internationalised host names must be given in punycode), with a
// host, no user information, and a path that names a file (not empty and not
// ending in '/'). A query is kept as is (presigned object-store URLs need it).
// A fragment, if present, must be exactly a canonical sha256 digest
// ("sha256:" and 64 lowercase hex digits); it pins a single file.
//
// An S3 reference is s3://bucket[/prefix][@version] or
// s3://bucket/key#sha256:<64 hex>: a bucket name as AWS allows it (3–63
// lowercase letters, digits, '.' and '-'), a key prefix of non-empty
// segments other than "." and "..", without '@', '#', '?' or '\', a version
// being an S3 object version id; a digest pins one object and excludes a
// version (see S3Source).
//
// Errors wrap cache.ErrInvalid.
func ParseRef(s string) (Ref, error) {
	r, err := parseRef(s)
	if err != nil {
		return Ref{}, fmt.Errorf("parsing reference %q: %w", truncate(s), err)
	}
	return r, nil
}

func parseRef(s string) (Ref, error) {
	if len(s) > MaxRefLength {
		return Ref{}, fmt.Errorf("%w: longer than %d bytes", cache.ErrInvalid, MaxRefLength)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f {
			return Ref{}, fmt.Errorf("%w: byte %#02x at offset %d: only printable ASCII without spaces is allowed", cache.ErrInvalid, c, i)
		}
	}
	scheme, _, ok := strings.Cut(s, "://")
	if !ok {
		return Ref{}, fmt.Errorf("%w: not of the form scheme://…", cache.ErrInvalid)
	}
	switch strings.ToLower(scheme) {
	case "http", "https":
		return parseHTTPRef(s)
	case "oci":
		return parseOCIRef(s[len("oci://"):])
	case "hf":
		return parseHFRef(s[len("hf://"):])
	case "s3":
		return parseS3Ref(s[len("s3://"):])
	default:
		return Ref{}, fmt.Errorf("%w: unsupported scheme %q (want oci, hf, s3, https or http)", cache.ErrInvalid, truncate(scheme))
	}
}

func parseHTTPRef(s string) (Ref, error) {
	rest, frag, hasFrag := strings.Cut(s, "#")
	u, err := parseHTTPURL(rest)
	if err != nil {
		return Ref{}, err
	}
	r := Ref{Kind: KindHTTP, URL: u}
	if hasFrag {
		d, err := cache.ParseDigest(frag)
		if err != nil {
			return Ref{}, fmt.Errorf("fragment must be a sha256 digest: %w", err)
		}
		r.Digest = d
	}
	return r, nil
}

// parseHTTPURL parses an absolute http(s) URL without fragment and applies
// the rules of ParseRef to it. The host is lower-cased.
func parseHTTPURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		// url.Error repeats the whole input; keep only the reason.
		if ue, ok := err.(*url.Error); ok {
			err = ue.Err
		}
		return nil, fmt.Errorf("%w: %v", cache.ErrInvalid, err)
	}
	if err := checkHTTPURL(u); err != nil {
		return nil, err
	}
	u.Host = strings.ToLower(u.Host)
	return u, nil
}

// checkHTTPURL checks an already parsed absolute URL: http or https, a host,
// no user information, no opaque part, a path that names a file.
func checkHTTPURL(u *url.URL) error {
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("%w: scheme %q is not http or https", cache.ErrInvalid, truncate(u.Scheme))
	case u.Opaque != "":
		return fmt.Errorf("%w: URL is opaque (want scheme://host/path)", cache.ErrInvalid)
	case u.User != nil:
		return fmt.Errorf("%w: user information in URLs is not allowed (use a credential instead)", cache.ErrInvalid)
	case u.Hostname() == "":
		return fmt.Errorf("%w: host is missing", cache.ErrInvalid)
	case strings.HasSuffix(u.Host, ":"):
		return fmt.Errorf("%w: empty port", cache.ErrInvalid)
	case u.Port() != "" && !validPort(u.Port()):
		return fmt.Errorf("%w: port %q out of range", cache.ErrInvalid, truncate(u.Port()))
	case u.Path == "" || strings.HasSuffix(u.Path, "/"):
		return fmt.Errorf("%w: URL path must name a file", cache.ErrInvalid)
	}
	return nil
}

func validPort(p string) bool {
	n, err := strconv.Atoi(p)
	return err == nil && n >= 1 && n <= 65535
}

// String returns the canonical form of the reference: ParseRef(r.String())
// yields an equal Ref. Two submissions of the same canonical string are the
// same request.
func (r Ref) String() string {
	switch r.Kind {
	case KindOCI:
		s := "oci://" + r.Registry + "/" + r.Repository
		if r.Tag != "" {
			s += ":" + r.Tag
		}
		if r.Digest != "" {
			s += "@" + r.Digest.String()
		}
		return s
	case KindHF:
		return "hf://" + r.Repository + "@" + r.Revision
	case KindS3:
		return s3RefString(r)
	}
	if r.URL == nil {
		return ""
	}
	s := r.URL.String()
	if r.Digest != "" {
		s += "#" + r.Digest.String()
	}
	return s
}

// ModelName is the name the reference's model is laid out under in the
// cache, derived from the reference alone, never from what its source
// answers: the repository for a hub model ("org/name"), the repository's
// last component under the ones before it for a registry model, and for a
// URL "<host>/<path>/<key>" (see HTTPSource), which no hub or registry
// model and no other URL is named; an S3 reference likewise, from
// "s3://bucket/prefix" (the key tells it from any https URL).
func (r Ref) ModelName() string {
	switch r.Kind {
	case KindHF:
		return r.Repository
	case KindOCI:
		return modelName(r.Repository)
	case KindHTTP, KindS3:
		if r.URL != nil {
			return urlModelName(r.URL)
		}
	}
	return ""
}

// Redacted is like String but replaces the query, which in presigned URLs
// carries credentials, with "REDACTED". Use it in logs and status.
func (r Ref) Redacted() string {
	if r.Kind != KindHTTP || r.URL == nil || r.URL.RawQuery == "" {
		return r.String()
	}
	u := *r.URL
	u.RawQuery = "REDACTED"
	return Ref{Kind: r.Kind, URL: &u, Digest: r.Digest}.String()
}

func truncate(s string) string {
	if len(s) > 120 {
		return s[:120] + "…"
	}
	return s
}
