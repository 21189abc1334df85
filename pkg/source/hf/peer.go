package hf

import (
	"context"
	"fmt"
	"os"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// hubConfirmation checks listings other nodes resolved against the hub's
// own listing at their commit: the same paths, an LFS file's sha256 and size
// as the hub lists them, a file stored in git of the size listed. The hub
// names a file stored in git only by its git blob id, so its sha256 from the
// other node is checked by the resolution's Verify, once its bytes are in
// the store. Reading the listing is one request (a page per thousand files);
// what sharing saves is reading the small files of every model on every
// node. The hub's listing, once read, also serves this node's own
// resolution. It is used by one goroutine at a time.
type hubConfirmation struct {
	listing []treeEntry       // the hub's, once read
	inGit   map[string]string // of the accepted model: git blob id by path
}

// check is SharedResolver's accept: m must be the hub's listing of repo at
// commit.
func (c *hubConfirmation) check(ctx context.Context, s *Source, repo, commit string, m content.Model) error {
	if m.Name != repo || m.Revision != commit {
		return fmt.Errorf("%w: resolved as %s@%s, not %s@%s", content.ErrInvalid, m.Name, m.Revision, repo, commit)
	}
	if c.listing == nil {
		entries, err := s.list(ctx, repo, commit)
		if err != nil {
			return fmt.Errorf("reading the hub's listing to check it: %w", err)
		}
		c.listing = entries
	}
	inGit, err := matchListing(m, c.listing)
	if err != nil {
		return fmt.Errorf("not the hub's listing of %s@%s: %w", repo, commit, err)
	}
	c.inGit = inGit
	return nil
}

// resolve resolves repo at commit from the hub, with its listing if check
// read it.
func (c *hubConfirmation) resolve(ctx context.Context, s *Source, repo, commit string) (*source.Resolution, error) {
	if c.listing == nil {
		return s.resolveAt(ctx, repo, commit)
	}
	return s.resolveListing(ctx, repo, commit, c.listing)
}

// resolution is the resolution of m, which check accepted: every file read
// from the hub at its commit, the files stored in git verified once stored.
func (c *hubConfirmation) resolution(s *Source, m content.Model) *source.Resolution {
	inGit := c.inGit
	res := s.resolutionOf(m)
	if len(inGit) > 0 {
		res.Verify = func(open func(digest.Digest) (*os.File, error)) error {
			if err := verifyGitBlobs(m, inGit, open); err != nil {
				s.untrusted.add(m.Name+"@"+m.Revision, struct{}{}, 1)
				return err
			}
			return nil
		}
	}
	return res
}

// distrusted says whether a listing of repo at commit from another node
// failed Verify here: it is then resolved from the hub alone.
func (s *Source) distrusted(repo, commit string) bool {
	_, ok := s.untrusted.get(repo + "@" + commit)
	return ok
}

// matchListing checks m's files against the hub's listing and returns the
// git blob id of each file stored in git, by path.
func matchListing(m content.Model, entries []treeEntry) (map[string]string, error) {
	if len(m.Files) != len(entries) {
		return nil, fmt.Errorf("%w: %d files, the hub lists %d", content.ErrInvalid, len(m.Files), len(entries))
	}
	files := make(map[string]content.Descriptor, len(m.Files))
	for _, f := range m.Files {
		files[f.Path] = f.Descriptor
	}
	inGit := make(map[string]string)
	for _, e := range entries {
		d, ok := files[e.Path]
		switch {
		case !ok:
			return nil, fmt.Errorf("%w: %q is not listed", content.ErrInvalid, fetch.Truncate(e.Path))
		case d.Size != e.Size:
			return nil, fmt.Errorf("%w: %q: %d bytes, the hub lists %d", content.ErrInvalid, fetch.Truncate(e.Path), d.Size, e.Size)
		case e.LFS != nil && d.Digest != digest.NewDigestFromEncoded(digest.SHA256, e.LFS.OID):
			return nil, fmt.Errorf("%w: %q: %s, the hub lists sha256:%s", content.ErrInvalid, fetch.Truncate(e.Path), d.Digest, e.LFS.OID)
		case e.LFS == nil:
			inGit[e.Path] = e.OID
		}
	}
	return inGit, nil
}

// verifyGitBlobs checks that the blob of each file of m stored in git has
// the git blob id the hub lists (inGit, by path).
func verifyGitBlobs(m content.Model, inGit map[string]string, open func(digest.Digest) (*os.File, error)) error {
	for _, f := range m.Files {
		want, ok := inGit[f.Path]
		if !ok {
			continue
		}
		r, err := open(f.Digest)
		if err != nil {
			return fmt.Errorf("%q: %w", f.Path, err)
		}
		got, err := readGitBlobID(r, f.Size)
		r.Close()
		if err != nil {
			return fmt.Errorf("%q: %w", f.Path, err)
		}
		if got != want {
			return fmt.Errorf("%w: %s@%s: %q (%s) has git blob id %s, the hub lists %s",
				source.ErrUnverified, m.Name, m.Revision, f.Path, f.Digest, got, want)
		}
	}
	return nil
}

// SharedResolver resolves a pinned reference once for a group of nodes: it
// returns the model another node resolved if accept approves it, and calls
// resolve (this node asks the origin) otherwise. Peers implement it
// (p2p.Swarm.SharedResolve, which names a peer whose answer accept refuses).
type SharedResolver func(ctx context.Context, pinned ref.Ref, resolve func(context.Context) (content.Model, error),
	accept func(content.Model) error) (content.Model, error)
