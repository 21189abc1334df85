package mirror

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/containerd/v2/core/remotes/docker"

	"github.com/weightd/weightd/pkg/content"
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
			if err := content.ValidateDigest(r.digest); err != nil {
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

// FuzzConfigureHostsMerge merges any node's hosts.toml behind the mirror.
// A file it refuses is left untouched with an ErrInvalid; one it merges is
// read by containerd 2.4.2 as the mirror followed by exactly the hosts
// containerd read from the original, merging again changes nothing, and
// restoring brings back the original byte for byte.
func FuzzConfigureHostsMerge(f *testing.F) {
	for _, s := range []string{
		corporateHosts, "", "server = \"https://quay.io\"\n", "# just a comment\n",
		"[host.\"https://a\"]\n[host.\"https://b\"]\n[host.\"https://a\".header]\nX = \"1\"\n",
		"[host.\"http://127.0.0.1:5001\"]\ncapabilities = [\"pull\"]\n",
		"host.\"https://dotted\".capabilities = [\"pull\"]\n",
		"server = \"quay.io/v1\"\noverride_path = true\n[header]\nA = [\"b\"]\n",
		"[host.'https://a\\\"b']\n", "[[host.\"https://a\"]]\n", "[host]\nx = 1\n",
	} {
		f.Add([]byte(s))
	}
	const mirrorURL = "http://127.0.0.1:5001"
	f.Fuzz(func(t *testing.T, original []byte) {
		root := t.TempDir()
		dir := filepath.Join(root, "quay.io")
		file := filepath.Join(dir, "hosts.toml")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(file, original, 0o644); err != nil {
			t.Fatal(err)
		}
		before, beforeErr := containerdHostsErr(root, "quay.io")
		if err := ConfigureHosts(root, mirrorURL, []string{"quay.io"}); err != nil {
			if !errors.Is(err, content.ErrInvalid) {
				t.Fatalf("merging %q: %v, not ErrInvalid", original, err)
			}
			if b, _ := os.ReadFile(file); !bytes.Equal(b, original) {
				t.Fatalf("merging %q failed (%v) but changed the file to %q", original, err, b)
			}
			return
		}
		merged, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if beforeErr == nil && len(bytes.TrimSpace(original)) > 0 {
			after, err := containerdHostsErr(root, "quay.io")
			if err != nil {
				t.Fatalf("containerd cannot read the merge of %q: %v\n%s", original, err, merged)
			}
			mirror := hostView{Scheme: "http", Host: "127.0.0.1:5001", Path: "/v2", Capabilities: docker.HostCapabilityPull | docker.HostCapabilityResolve}
			var rest []hostView
			for _, h := range before {
				if h.Scheme+"://"+h.Host != mirrorURL {
					rest = append(rest, h)
				}
			}
			if len(after) == 0 || !reflect.DeepEqual(after[0], mirror) || !reflect.DeepEqual(dedupeHosts(rest), after[1:]) {
				t.Fatalf("merging %q:\ncontainerd read before %+v\nafter %+v\nfrom %s", original, before, after, merged)
			}
		}
		if err := ConfigureHosts(root, mirrorURL, []string{"quay.io"}); err != nil {
			t.Fatalf("merging again: %v", err)
		}
		if again, _ := os.ReadFile(file); !bytes.Equal(again, merged) {
			t.Fatalf("merging %q again changed\n%s\ninto\n%s", original, merged, again)
		}
		if err := RestoreHosts(root, []string{"quay.io"}); err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(file); !bytes.Equal(b, original) {
			t.Fatalf("restored %q, want %q", b, original)
		}
	})
}

// dedupeHosts drops a host containerd lists twice (a [host."a"] table whose
// subtable comes after another host's): the merge lists it once.
func dedupeHosts(hosts []hostView) []hostView {
	var out []hostView
	for i, h := range hosts {
		if i == len(hosts)-1 || !slices.ContainsFunc(out, func(o hostView) bool { return reflect.DeepEqual(o, h) }) {
			out = append(out, h)
		}
	}
	return out
}
