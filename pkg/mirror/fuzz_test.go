package mirror

import (
	"strings"
	"testing"

	"github.com/weightd/weightd/pkg/cache"
)

// FuzzMirrorPath checks the request path parser on any input: what it
// accepts is valid in every part, names no path outside a repository, and
// is exactly the path it was parsed from.
func FuzzMirrorPath(f *testing.F) {
	for _, s := range []string{
		"/v2/", "/v2", "/v2/library/ubuntu/manifests/22.04",
		"/v2/a/b/c/manifests/sha256:" + hex64, "/v2/a/blobs/sha256:" + hex64,
		"/v2/../blobs/sha256:" + hex64, "/v2/a%2Fb/manifests/x", "/v2/a//b/manifests/x",
		"/v2/a/manifests/manifests/manifests", "/v2/a/blobs/uploads/", "/v2/_catalog",
		"/v2/a/manifests/sha512:" + hex64 + hex64, "/v2/a__b/manifests/x", "/v2/a.-b/blobs/x",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		r, aerr := parsePath(p)
		if aerr != nil {
			if aerr.status != 400 && aerr.status != 404 || aerr.code == "" || aerr.message == "" {
				t.Fatalf("parsePath(%q): error %+v", p, aerr)
			}
			if r != (route{}) {
				t.Fatalf("parsePath(%q): error with a route %+v", p, r)
			}
			return
		}
		switch r.kind {
		case routePing:
			if p != "/v2/" && p != "/v2" {
				t.Fatalf("parsePath(%q): ping", p)
			}
			return
		case routeManifest, routeBlob:
		default:
			t.Fatalf("parsePath(%q): kind %d", p, r.kind)
		}
		if validateRepository(r.repository) != nil || len(r.repository) > maxRepository {
			t.Fatalf("parsePath(%q): repository %q", p, r.repository)
		}
		for _, c := range strings.Split(r.repository, "/") {
			if c == "" || c == "." || c == ".." || strings.ContainsAny(c, "%\\\x00") {
				t.Fatalf("parsePath(%q): component %q", p, c)
			}
		}
		if (r.tag == "") == (r.digest == "") || (r.kind == routeBlob && r.tag != "") {
			t.Fatalf("parsePath(%q): tag %q digest %q", p, r.tag, r.digest)
		}
		ref, kind := r.tag, "manifests"
		if r.digest != "" {
			if err := cache.ValidateDigest(r.digest); err != nil {
				t.Fatalf("parsePath(%q): %v", p, err)
			}
			ref = r.digest.String()
		} else if !tagRE.MatchString(r.tag) {
			t.Fatalf("parsePath(%q): tag %q", p, r.tag)
		}
		if r.kind == routeBlob {
			kind = "blobs"
		}
		if got := "/v2/" + r.repository + "/" + kind + "/" + ref; got != p {
			t.Fatalf("parsePath(%q) = %q", p, got)
		}
	})
}
