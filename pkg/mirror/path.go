package mirror

import (
	"net/http"
	"regexp"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
)

// Grammar of the distribution API's path components, after the distribution
// project's reference grammar. Anything else is refused before it is used.
var (
	// One component of a repository name.
	componentRE = regexp.MustCompile(`^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*$`)
	// A tag.
	tagRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
	// A registry host: DNS labels separated by dots, or a bracketed IPv6
	// address, with an optional port.
	hostRE = regexp.MustCompile(`^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:.]+\])(?::[0-9]{1,5})?$`)
)

// Limits of the grammar.
const (
	maxRepository = 255
	maxHost       = 255
)

type routeKind int

const (
	routePing routeKind = iota + 1
	routeManifest
	routeBlob
)

// route is a parsed, validated request path.
type route struct {
	kind       routeKind
	repository string        // with routeManifest and routeBlob
	tag        string        // a manifest by tag
	digest     digest.Digest // a manifest by digest, or a blob
}

// parsePath parses the escaped path of a distribution API request:
//
//	/v2/                              ping
//	/v2/<name>/manifests/<tag|digest> a manifest
//	/v2/<name>/blobs/<digest>         a blob
//
// Every component is validated; any escape ('%') is refused, so the decoded
// and escaped forms are the same string.
func parsePath(p string) (route, *apiError) {
	if p == "/v2/" || p == "/v2" {
		return route{kind: routePing}, nil
	}
	rest, ok := strings.CutPrefix(p, "/v2/")
	if !ok {
		return route{}, errNotFound("UNSUPPORTED", "not a distribution API path")
	}
	parts := strings.Split(rest, "/")
	if len(parts) < 3 {
		return route{}, errNotFound("UNSUPPORTED", "unsupported path")
	}
	kind, ref := parts[len(parts)-2], parts[len(parts)-1]
	name := strings.Join(parts[:len(parts)-2], "/")
	var r route
	switch kind {
	case "manifests":
		r.kind = routeManifest
	case "blobs":
		r.kind = routeBlob
	default:
		return route{}, errNotFound("UNSUPPORTED", "unsupported path")
	}
	if err := validateRepository(name); err != nil {
		return route{}, err
	}
	r.repository = name
	switch {
	case r.kind == routeBlob || strings.Contains(ref, ":"):
		d, err := content.ParseDigest(ref)
		if err != nil {
			return route{}, &apiError{status: http.StatusBadRequest, code: "DIGEST_INVALID", message: "invalid digest: only sha256:<64 lowercase hex> is supported"}
		}
		r.digest = d
	case tagRE.MatchString(ref):
		r.tag = ref
	default:
		return route{}, &apiError{status: http.StatusBadRequest, code: "MANIFEST_INVALID", message: "invalid tag"}
	}
	return r, nil
}

// validateRepository checks a repository name: lowercase components joined
// by '/', at most 255 bytes.
func validateRepository(name string) *apiError {
	bad := &apiError{status: http.StatusBadRequest, code: "NAME_INVALID", message: "invalid repository name"}
	if name == "" || len(name) > maxRepository {
		return bad
	}
	for c := range strings.SplitSeq(name, "/") {
		if !componentRE.MatchString(c) {
			return bad
		}
	}
	return nil
}

// canonicalHost validates a registry host[:port] and returns it lowercased,
// with Docker Hub's aliases folded into "docker.io" (the name containerd
// sends as ns).
func canonicalHost(h string) (string, bool) {
	if h == "" || len(h) > maxHost || !hostRE.MatchString(h) {
		return "", false
	}
	if i := strings.LastIndexByte(h, ':'); i > strings.LastIndexByte(h, ']') && !validPort(h[i+1:]) {
		return "", false
	}
	return ref.CanonicalRegistry(h), true
}

func validPort(s string) bool {
	if s == "" || len(s) > 5 || s[0] == '0' {
		return false
	}
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
		n = n*10 + int(c-'0')
	}
	return n <= 65535
}
