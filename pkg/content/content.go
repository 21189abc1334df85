package content

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"regexp"
	"strings"

	"github.com/opencontainers/go-digest"
)

// Errors of weightd's stores and sources; test them with errors.Is.
var (
	ErrNotFound       = errors.New("not found")
	ErrInvalid        = errors.New("invalid argument")
	ErrDigestMismatch = errors.New("digest mismatch")
	ErrSizeMismatch   = errors.New("size mismatch")
	// ErrDenied is an origin's refusal of the credentials a request
	// carried, or of their absence (HTTP 401 or 403): not an outage.
	ErrDenied = errors.New("access denied")
	// ErrPermanent marks a source error that retrying cannot fix (404, 403,
	// a size the origin disagrees with). Wrap it with Permanent.
	ErrPermanent = errors.New("permanent source error")
)

// Permanent marks err as not worth retrying; its message is err's.
func Permanent(err error) error {
	if err == nil || errors.Is(err, ErrPermanent) {
		return err
	}
	return permanentError{err}
}

type permanentError struct{ error }

func (e permanentError) Unwrap() []error { return []error{e.error, ErrPermanent} }

// Descriptor names a blob: its sha256 digest and its size in bytes.
type Descriptor struct {
	Digest digest.Digest `json:"digest"`
	Size   int64         `json:"size"`
}

// Validate checks that the digest is a well-formed sha256 digest and the size
// is not negative. Paths are derived only from validated descriptors.
func (d Descriptor) Validate() error {
	if err := ValidateDigest(d.Digest); err != nil {
		return err
	}
	if d.Size < 0 {
		return fmt.Errorf("%w: negative size %d", ErrInvalid, d.Size)
	}
	return nil
}

// ValidateDigest accepts only canonical sha256 digests: "sha256:" and 64
// lowercase hex characters.
func ValidateDigest(d digest.Digest) error {
	if !strings.HasPrefix(string(d), "sha256:") {
		return fmt.Errorf("%w: digest %q: only sha256 is supported", ErrInvalid, truncate(string(d)))
	}
	if err := d.Validate(); err != nil {
		return fmt.Errorf("%w: digest %q: %v", ErrInvalid, truncate(string(d)), err)
	}
	return nil
}

// ParseDigest parses and validates a sha256 digest.
func ParseDigest(s string) (digest.Digest, error) {
	d := digest.Digest(s)
	return d, ValidateDigest(d)
}

// RangeOpener reads a blob from somewhere: an origin, a peer, a file.
type RangeOpener interface {
	// OpenRange returns a reader of the blob's bytes starting at offset off
	// and running to the end of the blob. Errors wrapped with Permanent are
	// not retried. The store's stall timeout covers OpenRange too: a source
	// that sends nothing for that long, opening or reading, is retried.
	OpenRange(ctx context.Context, off int64) (io.ReadCloser, error)
}

// Progress reports the bytes of a blob received and written so far (they
// become visible only once the whole blob is verified), and how many of
// them peers sent (Partial.WritePeerChunk) in this process's download. It
// is called from the download goroutines, every piece of about 1 MiB, and
// must not block.
type Progress func(done, fromPeers, total int64)

// File is one file of a model: its path inside the model and its blob.
type File struct {
	Path string `json:"path"`
	Descriptor
}

// Model is a named set of files at a revision, materialised as a directory of
// links into blobs/.
type Model struct {
	Name string `json:"name"` // "org/name"
	// Revision names the snapshot: a commit (40 lowercase hex digits, as
	// the hub names them), or for sources without commits a tag or branch.
	Revision string `json:"revision"`
	// Ref is the branch or tag ("main", "v1.0", "refs/pr/1") Revision was
	// resolved from, if any. Materialize writes refs/<Ref> holding Revision,
	// as the hub's own clients do, so that a loader asking for the branch
	// offline (HF_HUB_OFFLINE=1) finds the snapshot. It is no part of the
	// snapshot's identity: one snapshot may be named by several refs.
	Ref   string `json:"ref,omitempty"`
	Files []File `json:"files"`
}

// Validate checks the model name, revision, ref and every file path:
// relative, clean, no "..", no NUL, no duplicates.
func (m Model) Validate() error {
	if err := ValidateModelName(m.Name); err != nil {
		return err
	}
	if !revisionRE.MatchString(m.Revision) {
		return fmt.Errorf("%w: revision %q", ErrInvalid, truncate(m.Revision))
	}
	if m.Ref != "" {
		if err := ValidateRef(m.Ref); err != nil {
			return err
		}
	}
	seen := make(map[string]bool, len(m.Files))
	for _, f := range m.Files {
		if err := ValidatePath(f.Path); err != nil {
			return err
		}
		if seen[f.Path] {
			return fmt.Errorf("%w: duplicate file %q", ErrInvalid, f.Path)
		}
		seen[f.Path] = true
		if err := f.Validate(); err != nil {
			return fmt.Errorf("file %q: %w", f.Path, err)
		}
	}
	// A file may not also be a directory of another: "a" and "a/b".
	for p := range seen {
		for dir := path.Dir(p); dir != "."; dir = path.Dir(dir) {
			if seen[dir] {
				return fmt.Errorf("%w: %q is both a file and a directory", ErrInvalid, dir)
			}
		}
	}
	return nil
}

var (
	nameSegmentRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$`)
	revisionRE    = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
	refSegmentRE  = regexp.MustCompile(`^[A-Za-z0-9_-][A-Za-z0-9._-]*$`)
	commitRE      = regexp.MustCompile(`^[0-9a-f]{40}$`)
)

const maxRefLength = 255

// ValidateModelName accepts "name" or "org/name", as hubs name models, or
// "a/b/c", a name no hub gives (models fetched by URL: pkg/prefetch), where
// each part is letters, digits, '.', '_' or '-', not starting with
// punctuation, not ending with '.' or '-' and not containing "--" (which the
// hub layout uses as a separator: so a directory's name splits back into
// the one name it is of).
func ValidateModelName(name string) error {
	parts := strings.Split(name, "/")
	if len(parts) > 3 {
		return fmt.Errorf("%w: model name %q: at most two '/'", ErrInvalid, truncate(name))
	}
	for _, p := range parts {
		if !nameSegmentRE.MatchString(p) || strings.Contains(p, "--") || strings.HasSuffix(p, ".") || strings.HasSuffix(p, "-") {
			return fmt.Errorf("%w: model name %q", ErrInvalid, truncate(name))
		}
	}
	return nil
}

// ValidateRef accepts a branch or tag name as git does, within the
// characters the hub uses: '/'-separated components of letters, digits,
// '.', '_' and '-', none empty or starting with '.', at most 255 bytes, and
// not itself a commit (40 lowercase hex digits), which needs no ref.
func ValidateRef(ref string) error {
	if len(ref) > maxRefLength || commitRE.MatchString(ref) {
		return fmt.Errorf("%w: ref %q", ErrInvalid, truncate(ref))
	}
	for seg := range strings.SplitSeq(ref, "/") {
		if !refSegmentRE.MatchString(seg) {
			return fmt.Errorf("%w: ref %q", ErrInvalid, truncate(ref))
		}
	}
	return nil
}

// ValidatePath accepts a relative, clean, slash-separated path inside a model:
// no leading '/', no "." or ".." segments, no empty segments, no NUL or
// backslash, at most 1024 bytes.
func ValidatePath(p string) error {
	switch {
	case p == "" || len(p) > 1024:
		return fmt.Errorf("%w: file path length %d", ErrInvalid, len(p))
	case strings.ContainsAny(p, "\x00\\"):
		return fmt.Errorf("%w: file path %q contains NUL or backslash", ErrInvalid, truncate(p))
	case strings.HasPrefix(p, "/"):
		return fmt.Errorf("%w: file path %q is absolute", ErrInvalid, truncate(p))
	}
	for _, seg := range strings.Split(p, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return fmt.Errorf("%w: file path %q is not clean", ErrInvalid, truncate(p))
		}
	}
	return nil
}

func truncate(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}

// IsCommit reports whether rev is a commit as the hub names them: 40
// lowercase hex digits.
func IsCommit(rev string) bool { return commitRE.MatchString(rev) }
