package csi

import (
	"errors"
	"fmt"
	"path"
	"slices"
	"strings"

	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

// Volume attributes a pod author sets in volumeAttributes.
const (
	AttrModel    = "model"
	AttrPriority = "priority"
	AttrFiles    = "files"
)

// Volume attributes the kubelet adds when the CSIDriver has podInfoOnMount.
const (
	AttrPodName        = "csi.storage.k8s.io/pod.name"
	AttrPodNamespace   = "csi.storage.k8s.io/pod.namespace"
	AttrPodUID         = "csi.storage.k8s.io/pod.uid"
	AttrServiceAccount = "csi.storage.k8s.io/serviceAccount.name"
	AttrEphemeral      = "csi.storage.k8s.io/ephemeral"
)

// MaxFilePatterns bounds the globs one volume may list in its files attribute.
const MaxFilePatterns = 64

var knownAttributes = []string{
	AttrModel, AttrPriority, AttrFiles,
	AttrPodName, AttrPodNamespace, AttrPodUID, AttrServiceAccount, AttrEphemeral,
}

// ErrBadAttributes is wrapped by every error ParseAttributes returns.
var ErrBadAttributes = errors.New("bad volume attributes")

// Request is a volume's validated attributes.
type Request struct {
	Ref      ref.Ref
	Priority prefetch.Priority
	// Files are globs (path.Match syntax); a pattern without a slash matches
	// a file's base name, one with a slash its whole path. Empty means all.
	Files []string
	// Namespace, Pod and PodUID are the asking pod's, when the kubelet
	// passed them.
	Namespace, Pod, PodUID string
}

// ParseAttributes validates a volume's attributes. Unknown keys are refused
// so that a misspelt attribute fails loudly instead of being ignored.
func ParseAttributes(attrs map[string]string) (Request, error) {
	var unknown []string
	for k := range attrs {
		if !slices.Contains(knownAttributes, k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return Request{}, fmt.Errorf("%w: unknown attribute %q (known: model, priority, files)", ErrBadAttributes, unknown[0])
	}
	model := attrs[AttrModel]
	if model == "" {
		return Request{}, fmt.Errorf("%w: attribute %q is required (e.g. hf://org/name@main)", ErrBadAttributes, AttrModel)
	}
	r, err := ref.Parse(model)
	if err != nil {
		return Request{}, fmt.Errorf("%w: model: %w", ErrBadAttributes, err)
	}
	req := Request{Ref: r, Priority: prefetch.PriorityPod, Namespace: attrs[AttrPodNamespace], Pod: attrs[AttrPodName], PodUID: attrs[AttrPodUID]}
	switch p := attrs[AttrPriority]; p {
	case "", "pod":
	case "background":
		req.Priority = prefetch.PriorityBackground
	default:
		return Request{}, fmt.Errorf("%w: priority %q is not pod or background", ErrBadAttributes, p)
	}
	if f := attrs[AttrFiles]; f != "" {
		for p := range strings.SplitSeq(f, ",") {
			p = strings.TrimSpace(p)
			if p == "" {
				continue
			}
			if _, err := path.Match(p, ""); err != nil {
				return Request{}, fmt.Errorf("%w: files: pattern %q: %w", ErrBadAttributes, p, err)
			}
			req.Files = append(req.Files, p)
		}
		if len(req.Files) == 0 {
			return Request{}, fmt.Errorf("%w: files %q lists no pattern", ErrBadAttributes, f)
		}
		if len(req.Files) > MaxFilePatterns {
			return Request{}, fmt.Errorf("%w: files lists %d patterns, more than %d", ErrBadAttributes, len(req.Files), MaxFilePatterns)
		}
	}
	return req, nil
}

// Wants reports whether the file at p (a slash-separated path inside the
// model) is one the volume asked for.
func (r Request) Wants(p string) bool {
	if len(r.Files) == 0 {
		return true
	}
	for _, pat := range r.Files {
		name := p
		if !strings.Contains(pat, "/") {
			name = path.Base(p)
		}
		if ok, _ := path.Match(pat, name); ok {
			return true
		}
	}
	return false
}
