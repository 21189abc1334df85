package prefetch

import (
	"errors"
	"fmt"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

// ErrNeedsOrigin is CheckWithoutOrigin's error for a reference whose files
// only its origin can name.
var ErrNeedsOrigin = errors.New("only the reference's origin can say which files it names")

// CheckWithoutOrigin checks a model another node says r resolved to, for
// use while r's origin cannot be reached. Only a URL pinned to one file by
// digest ("https://host/file#sha256:…") is checkable: its model is exactly
// that file, named as httpsource.Source names it, and the file's bytes are checked
// against the digest as they arrive; another node only tells its size. Every
// other reference is refused with ErrNeedsOrigin: a hub listing, a model
// manifest behind a URL and a tag are the origin's word, and even an OCI
// manifest digest pins only the manifest, from which the model's files are
// derived, not the file list another node sends.
func CheckWithoutOrigin(r ref.Ref, m content.Model) error {
	if err := NeedsOrigin(r); err != nil {
		return err
	}
	if len(m.Files) != 1 {
		return fmt.Errorf("%w: %d files for %s, which names one", content.ErrInvalid, len(m.Files), r.Redacted())
	}
	want := source.SingleFileModel(r.URL, r.Digest, m.Files[0].Size)
	if m.Name != want.Name || m.Revision != want.Revision || m.Ref != "" || m.Files[0] != want.Files[0] {
		return fmt.Errorf("%w: %s@%s with %q (%s), not the file %s names", content.ErrInvalid,
			m.Name, m.Revision, m.Files[0].Path, m.Files[0].Digest, r.Redacted())
	}
	return m.Validate()
}

// NeedsOrigin returns an error wrapping ErrNeedsOrigin when no model
// another node gives for r can pass CheckWithoutOrigin.
func NeedsOrigin(r ref.Ref) error {
	if r.Kind != ref.KindHTTP || r.URL == nil || r.Digest == "" {
		return fmt.Errorf("%w: %s is not a file pinned by digest", ErrNeedsOrigin, r.Redacted())
	}
	return nil
}
