package loadtrace

import (
	"path"
	"strings"

	"github.com/weightd/weightd/pkg/content"
)

// classify maps an opened path to its model and file: under a models
// directory (models--org--name/snapshots/<rev>/<file>) the model is
// "org/name@rev" (of a model fetched by URL, models--a--b--c, "a/b/c@rev")
// and the file the path below the snapshot; under a blobs
// directory (<hex>) both are "sha256:<hex>" and blob is true. Prefixes end
// in "/". Anything else, a temporary snapshot or a path that ".." takes
// out of the directory included, is not ok.
func classify(modelsDirs, blobsDirs []string, p string) (model, file string, blob, ok bool) {
	p = path.Clean(p)
	for _, dir := range modelsDirs {
		rel, found := strings.CutPrefix(p, dir)
		if !found {
			continue
		}
		parts := strings.SplitN(rel, "/", 4)
		if len(parts) != 4 || parts[1] != "snapshots" {
			return "", "", false, false
		}
		repo, isRepo := strings.CutPrefix(parts[0], "models--")
		name := strings.ReplaceAll(repo, "--", "/")
		rev := parts[2]
		if !isRepo || content.ValidateModelName(name) != nil || rev == "" || rev[0] == '.' || len(rev) > 255 {
			return "", "", false, false
		}
		return name + "@" + rev, parts[3], false, true
	}
	for _, dir := range blobsDirs {
		hex, found := strings.CutPrefix(p, dir)
		if found && isSHA256Hex(hex) {
			return "sha256:" + hex, "sha256:" + hex, true, true
		}
	}
	return "", "", false, false
}

func isSHA256Hex(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := range len(s) {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
