package prefetch

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/weightd/weightd/pkg/cache"
)

// Grammar of OCI and Hugging Face references, after the distribution
// project's reference grammar and the hub's repository name rules.
var (
	// A registry host: DNS labels separated by dots, or a bracketed IPv6
	// address, with an optional port.
	ociRegistryRE = regexp.MustCompile(`^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:.]+\])(?::[0-9]{1,5})?$`)
	// One component of a repository path.
	ociComponentRE = regexp.MustCompile(`^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*$`)
	ociTagRE       = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
	// One part of a hub repository name: the organisation or the name.
	hfNameRE     = regexp.MustCompile(`^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$`)
	hfRevisionRE = regexp.MustCompile(`^[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*$`)
)

// Limits of the reference grammars.
const (
	maxOCIRepository = 255
	maxHFRevision    = 255
	// DefaultTag is the tag of an OCI reference that gives neither a tag nor
	// a digest.
	DefaultTag = "latest"
	// DefaultRevision is the revision of a hub reference that gives none.
	DefaultRevision = "main"
)

// parseOCIRef parses what follows "oci://": registry/repository[:tag][@digest].
func parseOCIRef(s string) (Ref, error) {
	name, dig, hasDigest := strings.Cut(s, "@")
	registry, repo, ok := strings.Cut(name, "/")
	if !ok || repo == "" {
		return Ref{}, fmt.Errorf("%w: want oci://registry/repository[:tag][@sha256:…]", cache.ErrInvalid)
	}
	if !ociRegistryRE.MatchString(registry) {
		return Ref{}, fmt.Errorf("%w: registry %q is not a host[:port]", cache.ErrInvalid, truncate(registry))
	}
	if i := strings.LastIndexByte(registry, ':'); i > strings.LastIndexByte(registry, ']') && !validPort(registry[i+1:]) {
		return Ref{}, fmt.Errorf("%w: registry port %q out of range", cache.ErrInvalid, truncate(registry[i+1:]))
	}
	r := Ref{Kind: KindOCI, Registry: strings.ToLower(registry)}
	// A tag follows the last ':' of the last path component.
	if i := strings.LastIndexByte(repo, ':'); i > strings.LastIndexByte(repo, '/') {
		repo, r.Tag = repo[:i], repo[i+1:]
		if !ociTagRE.MatchString(r.Tag) {
			return Ref{}, fmt.Errorf("%w: tag %q: want letters, digits, '_', '.', '-', at most 128, not starting with '.' or '-'", cache.ErrInvalid, truncate(r.Tag))
		}
	}
	if len(repo) > maxOCIRepository {
		return Ref{}, fmt.Errorf("%w: repository longer than %d bytes", cache.ErrInvalid, maxOCIRepository)
	}
	for c := range strings.SplitSeq(repo, "/") {
		if !ociComponentRE.MatchString(c) {
			return Ref{}, fmt.Errorf("%w: repository component %q: want lowercase letters and digits separated by '.', '_', '__' or '-'", cache.ErrInvalid, truncate(c))
		}
	}
	r.Repository = repo
	if hasDigest {
		d, err := cache.ParseDigest(dig)
		if err != nil {
			return Ref{}, fmt.Errorf("digest: %w", err)
		}
		r.Digest = d
	} else if r.Tag == "" {
		r.Tag = DefaultTag
	}
	return r, nil
}

// parseHFRef parses what follows "hf://": [org/]name[@revision].
func parseHFRef(s string) (Ref, error) {
	repo, rev, hasRev := strings.Cut(s, "@")
	parts := strings.Split(repo, "/")
	if len(parts) > 2 {
		return Ref{}, fmt.Errorf("%w: want hf://org/name[@revision]", cache.ErrInvalid)
	}
	for _, p := range parts {
		if !hfNameRE.MatchString(p) || strings.Contains(p, "--") || strings.Contains(p, "..") {
			return Ref{}, fmt.Errorf("%w: repository part %q: want letters, digits, '.', '_', '-' (no '--' or '..'), at most 96, starting and ending with a letter or digit", cache.ErrInvalid, truncate(p))
		}
	}
	if !hasRev {
		rev = DefaultRevision
	}
	if len(rev) > maxHFRevision || !hfRevisionRE.MatchString(rev) || strings.Contains(rev, "..") {
		return Ref{}, fmt.Errorf("%w: revision %q: want a branch, tag or commit of letters, digits, '.', '_', '-' and '/'", cache.ErrInvalid, truncate(rev))
	}
	return Ref{Kind: KindHF, Repository: repo, Revision: rev}, nil
}

// Pinned reports whether the reference names immutable content: an OCI
// digest, a hub commit (40 lowercase hex digits) or an HTTP file pinned by
// digest. A pinned reference resolves the same everywhere, always, so a
// resolution learned from a peer can be used without asking the origin.
func (r Ref) Pinned() bool {
	switch r.Kind {
	case KindHF:
		return isCommit(r.Revision)
	default:
		return r.Digest != ""
	}
}

// isCommit reports whether s is a full git commit id.
func isCommit(s string) bool {
	if len(s) != 40 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
