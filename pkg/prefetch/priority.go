package prefetch

import (
	"fmt"
	"strconv"

	"github.com/weightd/weightd/pkg/content"
)

// Priorities, lowest first.
const (
	// PriorityBackground is for what policies keep warm.
	PriorityBackground Priority = -1
	// PriorityNormal is for a person's or a script's request.
	PriorityNormal Priority = 0
	// PriorityPod is for a pod waiting now.
	PriorityPod Priority = 1
)

// Priority orders queued jobs: a higher priority runs first, equal ones in
// the order they were submitted, namespaces taking turns (see ForNamespace).
type Priority int

// String names the priority.
func (p Priority) String() string {
	switch p {
	case PriorityBackground:
		return "background"
	case PriorityNormal:
		return "normal"
	case PriorityPod:
		return "pod"
	}
	return strconv.Itoa(int(p))
}

// MarshalText writes the priority's name.
func (p Priority) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

// UnmarshalText reads a priority's name.
func (p *Priority) UnmarshalText(b []byte) error {
	v, err := ParsePriority(string(b))
	if err != nil {
		return err
	}
	*p = v
	return nil
}

// ParsePriority parses a priority name: background, normal or pod.
func ParsePriority(s string) (Priority, error) {
	for _, p := range []Priority{PriorityBackground, PriorityNormal, PriorityPod} {
		if s == p.String() {
			return p, nil
		}
	}
	return 0, fmt.Errorf("%w: priority %q: want background, normal or pod", content.ErrInvalid, truncate(s))
}
