package ref

import (
	"fmt"
	"regexp"
	"strings"
)

// The hub's repository name and revision rules.
var (
	// One part of a hub repository name: the organisation or the name.
	hfNameRE     = regexp.MustCompile(`^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$`)
	hfRevisionRE = regexp.MustCompile(`^[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*$`)
)

const (
	maxHFRevision = 255
	// DefaultRevision is the revision of a hub reference that gives none.
	DefaultRevision = "main"
)

// parseHF parses what follows "hf://": [org/]name[@revision].
func parseHF(s string) (Ref, error) {
	repo, rev, hasRev := strings.Cut(s, "@")
	parts := strings.Split(repo, "/")
	if len(parts) > 2 {
		return Ref{}, fmt.Errorf("%w: want hf://org/name[@revision]", ErrInvalid)
	}
	for _, p := range parts {
		if !hfNameRE.MatchString(p) || strings.Contains(p, "--") || strings.Contains(p, "..") {
			return Ref{}, fmt.Errorf("%w: repository part %q: want letters, digits, '.', '_', '-' (no '--' or '..'), at most 96, starting and ending with a letter or digit", ErrInvalid, truncate(p))
		}
	}
	if !hasRev {
		rev = DefaultRevision
	}
	if len(rev) > maxHFRevision || !hfRevisionRE.MatchString(rev) || strings.Contains(rev, "..") {
		return Ref{}, fmt.Errorf("%w: revision %q: want a branch, tag or commit of letters, digits, '.', '_', '-' and '/'", ErrInvalid, truncate(rev))
	}
	return Ref{Kind: KindHF, Repository: repo, Revision: rev}, nil
}
