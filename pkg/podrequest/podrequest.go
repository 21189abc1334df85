package podrequest

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/distribution/reference"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
)

// Pod annotations.
const (
	// Models lists model (or image) references, separated by commas and
	// optional spaces.
	Models = "weightd.io/models"
	// PrefetchImages, "true", asks for the pod's own container images.
	PrefetchImages = "weightd.io/prefetch-images"
	// RequireWarm, "true", asks the scheduler extender to place the pod only
	// on nodes that hold everything it asks for.
	RequireWarm = "weightd.io/require-warm"
	// Status is the agent's answer: "queued", "fetching 43%", "ready" or
	// "failed: <reason>".
	Status = "weightd.io/status"
)

// Limits on what one pod may ask.
const (
	MaxModelsValue = 8 << 10 // bytes of the models annotation
	MaxRefs        = 32      // references of one pod, images included
)

// Request is what a pod asks for.
type Request struct {
	// Models are the references of the models annotation, in order,
	// without duplicates.
	Models []ref.Ref
	// Images are the pod's container images when PrefetchImages is "true",
	// as oci:// references, without duplicates.
	Images []ref.Ref
	// RequireWarm is the RequireWarm annotation.
	RequireWarm bool
}

// Refs is every reference of the request: models, then images.
func (r Request) Refs() []ref.Ref {
	return append(append([]ref.Ref(nil), r.Models...), r.Images...)
}

// Empty reports whether the pod asks for nothing.
func (r Request) Empty() bool { return len(r.Models) == 0 && len(r.Images) == 0 }

// Parse reads a pod's request from its annotations and its container images
// (init containers first, as they start first). A pod without weightd
// annotations asks for nothing. Errors say which annotation and reference is
// wrong, and wrap ref.ErrInvalid for a reference that does not parse,
// content.ErrInvalid for anything else.
func Parse(annotations map[string]string, images []string) (Request, error) {
	var r Request
	var err error
	if r.RequireWarm, err = parseBool(annotations, RequireWarm); err != nil {
		return Request{}, err
	}
	seen := make(map[string]bool)
	if v, ok := annotations[Models]; ok {
		if len(v) > MaxModelsValue {
			return Request{}, fmt.Errorf("%w: annotation %s: %d bytes, more than %d", content.ErrInvalid, Models, len(v), MaxModelsValue)
		}
		for i, s := range strings.Split(v, ",") {
			s = strings.TrimSpace(s)
			if s == "" {
				continue
			}
			parsed, err := ref.Parse(s)
			if err != nil {
				return Request{}, fmt.Errorf("annotation %s, reference %d: %w", Models, i+1, err)
			}
			if !seen[parsed.String()] {
				seen[parsed.String()] = true
				r.Models = append(r.Models, parsed)
			}
		}
	}
	prefetchImages, err := parseBool(annotations, PrefetchImages)
	if err != nil {
		return Request{}, err
	}
	if prefetchImages {
		for _, image := range images {
			parsed, err := ImageRef(image)
			if err != nil {
				return Request{}, fmt.Errorf("annotation %s: container image %q: %w", PrefetchImages, truncate(image), err)
			}
			if !seen[parsed.String()] {
				seen[parsed.String()] = true
				r.Images = append(r.Images, parsed)
			}
		}
	}
	if n := len(r.Models) + len(r.Images); n > MaxRefs {
		return Request{}, fmt.Errorf("%w: %d references, more than %d", content.ErrInvalid, n, MaxRefs)
	}
	return r, nil
}

func parseBool(annotations map[string]string, key string) (bool, error) {
	v, ok := annotations[key]
	if !ok {
		return false, nil
	}
	b, err := strconv.ParseBool(strings.TrimSpace(v))
	if err != nil {
		return false, fmt.Errorf("%w: annotation %s: %q is not true or false", content.ErrInvalid, key, truncate(v))
	}
	return b, nil
}

// ImageRef turns a container image as a pod spec names it ("nginx",
// "ghcr.io/org/app:v1", "registry:5000/app@sha256:…") into an oci://
// reference, normalised as the kubelet does: Docker Hub when no registry is
// named, "library/" for official images, "latest" when neither tag nor
// digest is given.
func ImageRef(image string) (ref.Ref, error) {
	named, err := reference.ParseNormalizedNamed(image)
	if err != nil {
		return ref.Ref{}, fmt.Errorf("%w: %v", ref.ErrInvalid, err)
	}
	named = reference.TagNameOnly(named)
	s := "oci://" + reference.Domain(named) + "/" + reference.Path(named)
	if t, ok := named.(reference.Tagged); ok {
		s += ":" + t.Tag()
	}
	if d, ok := named.(reference.Digested); ok {
		s += "@" + d.Digest().String()
	}
	r, err := ref.Parse(s)
	if err != nil {
		return ref.Ref{}, errors.Unwrap(err)
	}
	return r, nil
}

func truncate(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
