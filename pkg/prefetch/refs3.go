package prefetch

import (
	"fmt"
	"net/netip"
	"net/url"
	"regexp"
	"strings"

	"github.com/weightd/weightd/pkg/cache"
)

var (
	// s3BucketRE is an S3 bucket name as AWS allows it today (3–63
	// lowercase letters, digits, '.' and '-', a letter or digit at each
	// end): such a name is also a valid DNS label sequence, which
	// virtual-hosted-style requests need.
	s3BucketRE = regexp.MustCompile(`^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$`)
	// s3VersionRE is an S3 object version id: AWS's are opaque URL-safe
	// base64-like strings, other stores use UUIDs or "null".
	// Its length (at most maxS3Key) is checked apart: RE2 repeats at most
	// 1000 times.
	s3VersionRE = regexp.MustCompile(`^[A-Za-z0-9._+/=-]+$`)
)

// maxS3Key is the longest object key S3 allows, in bytes.
const maxS3Key = 1024

// parseS3Ref parses what follows "s3://": bucket[/prefix][@version] or
// bucket/key#sha256:<64 hex>. The prefix is a key prefix of '/'-separated
// segments, none empty, "." or "..", without '@', '#', '?' or '\'; a
// trailing '/' is dropped.
func parseS3Ref(s string) (Ref, error) {
	rest, frag, pinned := strings.Cut(s, "#")
	loc, version, versioned := strings.Cut(rest, "@")
	bucket, prefix, _ := strings.Cut(loc, "/")
	prefix = strings.TrimSuffix(prefix, "/")
	if err := validS3Bucket(bucket); err != nil {
		return Ref{}, err
	}
	if err := validS3Prefix(prefix); err != nil {
		return Ref{}, err
	}
	r := Ref{Kind: KindS3, URL: &url.URL{Scheme: "s3", Host: bucket, Path: "/" + prefix}}
	if versioned {
		if len(version) > maxS3Key || !s3VersionRE.MatchString(version) {
			return Ref{}, fmt.Errorf("%w: version %q: want an S3 version id (letters, digits, '.', '_', '+', '/', '=', '-')", cache.ErrInvalid, truncate(version))
		}
		r.Revision = version
	}
	if pinned {
		d, err := cache.ParseDigest(frag)
		switch {
		case err != nil:
			return Ref{}, fmt.Errorf("fragment must be a sha256 digest: %w", err)
		case versioned:
			return Ref{}, fmt.Errorf("%w: a digest pins one object; a version pins a prefix's model.json: give one, not both", cache.ErrInvalid)
		case prefix == "":
			return Ref{}, fmt.Errorf("%w: a reference pinned by digest must name an object key", cache.ErrInvalid)
		}
		r.Digest = d
	}
	return r, nil
}

func validS3Bucket(b string) error {
	switch {
	case !s3BucketRE.MatchString(b):
		return fmt.Errorf("%w: bucket %q: want 3 to 63 lowercase letters, digits, '.' and '-', starting and ending with a letter or digit", cache.ErrInvalid, truncate(b))
	case strings.Contains(b, ".."):
		return fmt.Errorf("%w: bucket %q: two adjacent periods", cache.ErrInvalid, truncate(b))
	}
	if _, err := netip.ParseAddr(b); err == nil {
		return fmt.Errorf("%w: bucket %q: an IP address is not a bucket name", cache.ErrInvalid, truncate(b))
	}
	return nil
}

func validS3Prefix(p string) error {
	if p == "" {
		return nil // the whole bucket
	}
	if len(p) > maxS3Key {
		return fmt.Errorf("%w: prefix longer than %d bytes", cache.ErrInvalid, maxS3Key)
	}
	if i := strings.IndexAny(p, "@#?\\"); i >= 0 {
		return fmt.Errorf("%w: prefix %q: %q is not allowed in it", cache.ErrInvalid, truncate(p), p[i])
	}
	for seg := range strings.SplitSeq(p, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return fmt.Errorf("%w: prefix %q: empty, \".\" and \"..\" segments are not allowed", cache.ErrInvalid, truncate(p))
		}
	}
	return nil
}

// s3RefString is the canonical form of an S3 reference.
func s3RefString(r Ref) string {
	if r.URL == nil {
		return ""
	}
	s := "s3://" + r.URL.Host
	if p := s3Prefix(r); p != "" {
		s += "/" + p
	}
	if r.Revision != "" {
		s += "@" + r.Revision
	}
	if r.Digest != "" {
		s += "#" + r.Digest.String()
	}
	return s
}

// s3Prefix is the reference's key prefix (or pinned object's key), without
// leading or trailing '/'.
func s3Prefix(r Ref) string { return strings.TrimPrefix(r.URL.Path, "/") }
