package ref

import (
	"fmt"
	"regexp"
	"strings"
)

// The OCI grammar, after the distribution project's reference grammar.
var (
	// A registry host: DNS labels separated by dots, or a bracketed IPv6
	// address, with an optional port.
	ociRegistryRE = regexp.MustCompile(`^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:.]+\])(?::[0-9]{1,5})?$`)
	// One component of a repository path.
	ociComponentRE = regexp.MustCompile(`^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*$`)
	ociTagRE       = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
)

const (
	maxOCIRepository = 255
	// DefaultTag is the tag of an OCI reference that gives neither a tag nor
	// a digest.
	DefaultTag = "latest"
)

// parseOCI parses what follows "oci://": registry/repository[:tag][@digest].
func parseOCI(s string) (Ref, error) {
	name, dig, hasDigest := strings.Cut(s, "@")
	registry, repo, ok := strings.Cut(name, "/")
	if !ok || repo == "" {
		return Ref{}, fmt.Errorf("%w: want oci://registry/repository[:tag][@sha256:…]", ErrInvalid)
	}
	if !ValidRegistry(registry) {
		return Ref{}, fmt.Errorf("%w: registry %q is not a host[:port]", ErrInvalid, truncate(registry))
	}
	if i := strings.LastIndexByte(registry, ':'); i > strings.LastIndexByte(registry, ']') && !ValidPort(registry[i+1:]) {
		return Ref{}, fmt.Errorf("%w: registry port %q out of range", ErrInvalid, truncate(registry[i+1:]))
	}
	r := Ref{Kind: KindOCI, Registry: strings.ToLower(registry)}
	// A tag follows the last ':' of the last path component.
	if i := strings.LastIndexByte(repo, ':'); i > strings.LastIndexByte(repo, '/') {
		repo, r.Tag = repo[:i], repo[i+1:]
		if !ValidTag(r.Tag) {
			return Ref{}, fmt.Errorf("%w: tag %q: want letters, digits, '_', '.', '-', at most 128, not starting with '.' or '-'", ErrInvalid, truncate(r.Tag))
		}
	}
	if err := checkRepository(repo); err != nil {
		return Ref{}, err
	}
	r.Repository = repo
	if hasDigest {
		d, err := parseDigest(dig)
		if err != nil {
			return Ref{}, fmt.Errorf("digest: %w", err)
		}
		r.Digest = d
	} else if r.Tag == "" {
		r.Tag = DefaultTag
	}
	return r, nil
}

// ValidRegistry reports whether host has the form of a registry
// host[:port]: DNS labels separated by dots, or a bracketed IPv6 address,
// and an optional port of up to five digits (Parse also checks the port's
// range).
func ValidRegistry(host string) bool { return ociRegistryRE.MatchString(host) }

// ValidRepository reports whether path is a repository of an OCI
// reference: at most 255 bytes of '/'-separated components of lowercase
// letters and digits, separated by '.', '_', '__' or '-'.
func ValidRepository(path string) bool { return checkRepository(path) == nil }

// ValidTag reports whether tag is a tag of an OCI reference: letters,
// digits, '_', '.' and '-', at most 128, not starting with '.' or '-'.
func ValidTag(tag string) bool { return ociTagRE.MatchString(tag) }

func checkRepository(repo string) error {
	if len(repo) > maxOCIRepository {
		return fmt.Errorf("%w: repository longer than %d bytes", ErrInvalid, maxOCIRepository)
	}
	for c := range strings.SplitSeq(repo, "/") {
		if !ociComponentRE.MatchString(c) {
			return fmt.Errorf("%w: repository component %q: want lowercase letters and digits separated by '.', '_', '__' or '-'", ErrInvalid, truncate(c))
		}
	}
	return nil
}
