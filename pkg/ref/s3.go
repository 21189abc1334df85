package ref

import (
	"fmt"
	"net/netip"
	"net/url"
	"regexp"
	"strings"
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

// parseS3 parses what follows "s3://": bucket[/prefix][@version] or
// bucket/key#sha256:<64 hex>. The prefix is a key prefix of '/'-separated
// segments, none empty, "." or "..", without '@', '#', '?' or '\'; a
// trailing '/' is dropped.
func parseS3(s string) (Ref, error) {
	rest, frag, pinned := strings.Cut(s, "#")
	loc, version, versioned := strings.Cut(rest, "@")
	bucket, prefix, _ := strings.Cut(loc, "/")
	prefix = strings.TrimSuffix(prefix, "/")
	if err := CheckS3Bucket(bucket); err != nil {
		return Ref{}, err
	}
	if err := checkS3Prefix(prefix); err != nil {
		return Ref{}, err
	}
	r := Ref{Kind: KindS3, URL: &url.URL{Scheme: "s3", Host: bucket, Path: "/" + prefix}}
	if versioned {
		if len(version) > maxS3Key || !s3VersionRE.MatchString(version) {
			return Ref{}, fmt.Errorf("%w: version %q: want an S3 version id (letters, digits, '.', '_', '+', '/', '=', '-')", ErrInvalid, truncate(version))
		}
		r.Revision = version
	}
	if pinned {
		d, err := parseDigest(frag)
		switch {
		case err != nil:
			return Ref{}, fmt.Errorf("fragment must be a sha256 digest: %w", err)
		case versioned:
			return Ref{}, fmt.Errorf("%w: a digest pins one object; a version pins a prefix's model.json: give one, not both", ErrInvalid)
		case prefix == "":
			return Ref{}, fmt.Errorf("%w: a reference pinned by digest must name an object key", ErrInvalid)
		}
		r.Digest = d
	}
	return r, nil
}

// CheckS3Bucket checks an S3 bucket name as Parse does: 3 to 63 lowercase
// letters, digits, '.' and '-', a letter or digit at each end, no two
// adjacent periods, not an IP address. Errors wrap ErrInvalid.
func CheckS3Bucket(b string) error {
	switch {
	case !s3BucketRE.MatchString(b):
		return fmt.Errorf("%w: bucket %q: want 3 to 63 lowercase letters, digits, '.' and '-', starting and ending with a letter or digit", ErrInvalid, truncate(b))
	case strings.Contains(b, ".."):
		return fmt.Errorf("%w: bucket %q: two adjacent periods", ErrInvalid, truncate(b))
	}
	if _, err := netip.ParseAddr(b); err == nil {
		return fmt.Errorf("%w: bucket %q: an IP address is not a bucket name", ErrInvalid, truncate(b))
	}
	return nil
}

func checkS3Prefix(p string) error {
	if p == "" {
		return nil // the whole bucket
	}
	if len(p) > maxS3Key {
		return fmt.Errorf("%w: prefix longer than %d bytes", ErrInvalid, maxS3Key)
	}
	if i := strings.IndexAny(p, "@#?\\"); i >= 0 {
		return fmt.Errorf("%w: prefix %q: %q is not allowed in it", ErrInvalid, truncate(p), p[i])
	}
	for seg := range strings.SplitSeq(p, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return fmt.Errorf("%w: prefix %q: empty, \".\" and \"..\" segments are not allowed", ErrInvalid, truncate(p))
		}
	}
	return nil
}

// s3String is the canonical form of an S3 reference.
func s3String(r Ref) string {
	if r.URL == nil {
		return ""
	}
	s := "s3://" + r.URL.Host
	if p := r.KeyPrefix(); p != "" {
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

// KeyPrefix is an S3 reference's key prefix, or its pinned object's key,
// without leading or trailing '/': empty for the whole bucket and for
// other kinds of reference.
func (r Ref) KeyPrefix() string {
	if r.Kind != KindS3 || r.URL == nil {
		return ""
	}
	return strings.TrimPrefix(r.URL.Path, "/")
}
