package oci

import (
	"cmp"
	"fmt"
	"runtime"
	"strings"

	"github.com/weightd/weightd/pkg/content"
)

// ociPlatform is the platform of an index entry.
type ociPlatform struct {
	OS           string `json:"os"`
	Architecture string `json:"architecture"`
	Variant      string `json:"variant"`
}

func (p ociPlatform) String() string {
	s := p.OS + "/" + p.Architecture
	if p.Variant != "" {
		s += "/" + p.Variant
	}
	return s
}

// Platform is the platform whose manifest is picked from an index.
type Platform struct {
	OS           string
	Architecture string
	Variant      string // "v8" for arm64, "v7" for arm, "" for others unless set
}

// DefaultPlatform is the platform the agent runs on.
func DefaultPlatform() Platform {
	return Platform{OS: runtime.GOOS, Architecture: runtime.GOARCH}.normalize()
}

func (p Platform) String() string {
	return ociPlatform(p).String()
}

// normalize maps architecture aliases and default variants to one form.
func (p Platform) normalize() Platform {
	p.OS = strings.ToLower(p.OS)
	p.Architecture = strings.ToLower(p.Architecture)
	p.Variant = strings.ToLower(p.Variant)
	switch p.Architecture {
	case "x86_64", "x86-64":
		p.Architecture = "amd64"
	case "aarch64":
		p.Architecture = "arm64"
	case "armhf":
		p.Architecture, p.Variant = "arm", "v7"
	case "armel":
		p.Architecture, p.Variant = "arm", "v6"
	}
	switch {
	case p.Architecture == "arm64" && (p.Variant == "" || p.Variant == "8"):
		p.Variant = "v8"
	case p.Architecture == "arm" && p.Variant == "":
		p.Variant = "v7"
	case p.Architecture == "arm" && len(p.Variant) == 1:
		p.Variant = "v" + p.Variant
	case p.Architecture == "amd64" && p.Variant == "v1":
		p.Variant = ""
	}
	return p
}

// match scores how well an index entry's platform suits p: 0 not at all, 2
// exactly, 1 compatibly (an entry without variant, or an older arm variant).
func (p Platform) match(e *ociPlatform) int {
	if e == nil {
		return 0
	}
	q := Platform{OS: e.OS, Architecture: e.Architecture, Variant: e.Variant}
	variantGiven := q.Variant != ""
	q = q.normalize()
	switch {
	case q.OS != p.OS || q.Architecture != p.Architecture:
		return 0
	case q.Variant == p.Variant && variantGiven:
		return 2
	case q.Variant == p.Variant, !variantGiven:
		return 1
	case p.Architecture == "arm" && q.Variant < p.Variant:
		return 1
	}
	return 0
}

// selectManifest picks the entry of an index for platform p: the best match;
// in an index whose entries carry no platform at all (an artifact index),
// the first entry. Errors wrap content.ErrNotFound.
func selectManifest(doc *ociDocument, p Platform) (ociDescriptor, error) {
	best, bestScore, anyPlatform := -1, 0, false
	for i, m := range doc.Manifests {
		if m.Platform != nil {
			anyPlatform = true
		}
		if s := p.match(m.Platform); s > bestScore {
			best, bestScore = i, s
		}
	}
	if best >= 0 {
		return doc.Manifests[best], nil
	}
	if !anyPlatform && len(doc.Manifests) > 0 {
		return doc.Manifests[0], nil
	}
	var have []string
	for _, m := range doc.Manifests {
		if m.Platform != nil && m.Platform.OS != "unknown" {
			have = append(have, m.Platform.String())
		}
	}
	return ociDescriptor{}, fmt.Errorf("%w: no manifest for %s in the index (it has %s)", content.ErrNotFound, p, cmp.Or(strings.Join(have, ", "), "none"))
}
