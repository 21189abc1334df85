package ref

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// ErrInvalid is wrapped by every error about a reference that does not
// follow the grammar; test for it with errors.Is.
var ErrInvalid = errors.New("invalid reference")

// MaxLength is the longest reference Parse accepts, in bytes.
const MaxLength = 4096

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
// prefix without a trailing '/', or empty for the whole bucket; see
// KeyPrefix), Revision the S3 version id of the prefix's model.json when
// pinned by "@version", and Digest the digest of the one object Path names
// when pinned by "#sha256:…".
type Ref struct {
	Kind       Kind
	URL        *url.URL
	Digest     digest.Digest
	Registry   string
	Repository string
	Tag        string
	Revision   string
}

// Parse parses and validates a reference of any kind, following the
// grammar in the package documentation. Errors wrap ErrInvalid and quote
// the reference, truncated.
func Parse(s string) (Ref, error) {
	r, err := parse(s)
	if err != nil {
		return Ref{}, fmt.Errorf("parsing reference %q: %w", truncate(s), err)
	}
	return r, nil
}

func parse(s string) (Ref, error) {
	if len(s) > MaxLength {
		return Ref{}, fmt.Errorf("%w: longer than %d bytes", ErrInvalid, MaxLength)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f {
			return Ref{}, fmt.Errorf("%w: byte %#02x at offset %d: only printable ASCII without spaces is allowed", ErrInvalid, c, i)
		}
	}
	scheme, _, ok := strings.Cut(s, "://")
	if !ok {
		return Ref{}, fmt.Errorf("%w: not of the form scheme://…", ErrInvalid)
	}
	switch strings.ToLower(scheme) {
	case "http", "https":
		return parseHTTP(s)
	case "oci":
		return parseOCI(s[len("oci://"):])
	case "hf":
		return parseHF(s[len("hf://"):])
	case "s3":
		return parseS3(s[len("s3://"):])
	default:
		return Ref{}, fmt.Errorf("%w: unsupported scheme %q (want oci, hf, s3, https or http)", ErrInvalid, truncate(scheme))
	}
}

func parseHTTP(s string) (Ref, error) {
	rest, frag, hasFrag := strings.Cut(s, "#")
	u, err := parseHTTPURL(rest)
	if err != nil {
		return Ref{}, err
	}
	r := Ref{Kind: KindHTTP, URL: u}
	if hasFrag {
		d, err := parseDigest(frag)
		if err != nil {
			return Ref{}, fmt.Errorf("fragment must be a sha256 digest: %w", err)
		}
		r.Digest = d
	}
	return r, nil
}

// parseHTTPURL parses an absolute http(s) URL without fragment and applies
// CheckHTTPURL to it. The host is lower-cased.
func parseHTTPURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		// url.Error repeats the whole input; keep only the reason.
		if ue, ok := err.(*url.Error); ok {
			err = ue.Err
		}
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := CheckHTTPURL(u); err != nil {
		return nil, err
	}
	u.Host = strings.ToLower(u.Host)
	return u, nil
}

// CheckHTTPURL checks an already parsed absolute URL as Parse checks an
// http reference: http or https, a host, no user information, no opaque
// part, a port (if any) from 1 to 65535, a path that names a file. Errors
// wrap ErrInvalid.
func CheckHTTPURL(u *url.URL) error {
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("%w: scheme %q is not http or https", ErrInvalid, truncate(u.Scheme))
	case u.Opaque != "":
		return fmt.Errorf("%w: URL is opaque (want scheme://host/path)", ErrInvalid)
	case u.User != nil:
		return fmt.Errorf("%w: user information in URLs is not allowed (use a credential instead)", ErrInvalid)
	case u.Hostname() == "":
		return fmt.Errorf("%w: host is missing", ErrInvalid)
	case strings.HasSuffix(u.Host, ":"):
		return fmt.Errorf("%w: empty port", ErrInvalid)
	case u.Port() != "" && !ValidPort(u.Port()):
		return fmt.Errorf("%w: port %q out of range", ErrInvalid, truncate(u.Port()))
	case u.Path == "" || strings.HasSuffix(u.Path, "/"):
		return fmt.Errorf("%w: URL path must name a file", ErrInvalid)
	}
	return nil
}

// ValidPort reports whether p is a TCP port number from 1 to 65535.
func ValidPort(p string) bool {
	n, err := strconv.Atoi(p)
	return err == nil && n >= 1 && n <= 65535
}

// parseDigest accepts only a canonical sha256 digest: "sha256:" and 64
// lowercase hex digits.
func parseDigest(s string) (digest.Digest, error) {
	d := digest.Digest(s)
	if err := content.ValidateDigest(d); err != nil {
		return "", fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return d, nil
}

// String returns the canonical form of the reference: Parse(r.String())
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
		return s3String(r)
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

// Origin names the service the reference's bytes come from, as the
// origin limits know it: an OCI registry's host (with its port), "hf" for
// the model hub, "s3" for the object store, and an http(s) URL's host.
func (r Ref) Origin() string {
	switch r.Kind {
	case KindOCI:
		return CanonicalRegistry(r.Registry)
	case KindHF, KindS3:
		return string(r.Kind)
	}
	if r.URL == nil {
		return ""
	}
	return strings.ToLower(r.URL.Host)
}

// CanonicalRegistry is a registry host lower-cased, with Docker Hub's
// aliases folded into "docker.io" (the name containerd sends a mirror), so
// that every name of one registry is one origin and one mirror namespace.
func CanonicalRegistry(host string) string {
	host = strings.ToLower(host)
	switch host {
	case "index.docker.io", "registry-1.docker.io":
		return "docker.io"
	}
	return host
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

// Pinned reports whether the reference names immutable content: an OCI
// digest, a hub commit (40 lowercase hex digits), or an HTTP file or S3
// object pinned by digest. A pinned reference resolves the same everywhere,
// always, so a resolution learned from a peer can be used without asking
// the origin.
func (r Ref) Pinned() bool {
	switch r.Kind {
	case KindHF:
		return content.IsCommit(r.Revision)
	default:
		return r.Digest != ""
	}
}

func truncate(s string) string {
	if len(s) > 120 {
		return s[:120] + "…"
	}
	return s
}
