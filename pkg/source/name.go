package source

import (
	"crypto/sha256"
	"encoding/hex"
	"net/url"
	"path"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// ModelName is the name r's model is laid out under in the cache, derived
// from the reference alone, never from what its source answers: the
// repository for a hub model ("org/name"), the repository's last component
// under the ones before it for a registry model, and for a URL
// "<host>/<path>/<key>" (see httpsource.Source), which no hub or registry model and
// no other URL is named; an S3 reference likewise, from "s3://bucket/prefix"
// (the key tells it from any https URL).
func ModelName(r ref.Ref) string {
	switch r.Kind {
	case ref.KindHF:
		return r.Repository
	case ref.KindOCI:
		return modelName(r.Repository)
	case ref.KindHTTP, ref.KindS3:
		if r.URL != nil {
			return urlModelName(r.URL)
		}
	}
	return ""
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
	host := fetch.Sanitize(u.Host, 96, "host")
	name := fetch.Sanitize(strings.TrimPrefix(u.Path, "/"), 96, "file")
	sum := sha256.Sum256([]byte(u.Scheme + "://" + strings.ToLower(u.Host) + u.EscapedPath()))
	return host + "/" + name + "/" + hex.EncodeToString(sum[:8])
}

// SingleFileModel names the one-file model of a digest-pinned URL, as the
// http and s3 sources lay it out and as a peer's answer for it is checked
// without its origin (see pkg/source/http).
func SingleFileModel(u *url.URL, d digest.Digest, size int64) content.Model {
	file := fetch.Sanitize(path.Base(u.Path), 255, "blob")
	return content.Model{
		Name:     urlModelName(u),
		Revision: d.Encoded()[:12],
		Files:    []content.File{{Path: file, Descriptor: content.Descriptor{Digest: d, Size: size}}},
	}
}

// modelName maps a repository path to a model name: the last component is
// the name, the ones before it joined with '.' the organisation, each part
// sanitised to the characters model names allow.
func modelName(repository string) string {
	parts := strings.Split(repository, "/")
	name := fetch.Sanitize(parts[len(parts)-1], 96, "model")
	if len(parts) == 1 {
		return name
	}
	return fetch.Sanitize(strings.Join(parts[:len(parts)-1], "."), 96, "org") + "/" + name
}
