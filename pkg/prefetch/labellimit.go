package prefetch

import (
	"sync"
)

// OtherLabel is the label value a LabelLimiter gives every value beyond its
// first n.
const OtherLabel = "other"

// LabelLimiter bounds the values of a metric label whose domain is not
// bounded, such as model names: the first n distinct values it sees keep
// their name for the life of the process, every later one becomes
// OtherLabel. A metric labelled through it has at most n+1 series per other
// label combination. Its methods are safe for concurrent use.
type LabelLimiter struct {
	mu   sync.Mutex
	n    int
	seen map[string]struct{}
}

// NewLabelLimiter returns a limiter that keeps n distinct values (n < 0 is
// taken as 0: every value is OtherLabel).
func NewLabelLimiter(n int) *LabelLimiter {
	return &LabelLimiter{n: max(n, 0), seen: make(map[string]struct{})}
}

// Label returns v if v is among the first n distinct values seen (seeing it
// now if there is room), else OtherLabel. The empty value is OtherLabel.
func (l *LabelLimiter) Label(v string) string {
	if v == "" || v == OtherLabel {
		return OtherLabel
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.seen[v]; ok {
		return v
	}
	if len(l.seen) >= l.n {
		return OtherLabel
	}
	l.seen[v] = struct{}{}
	return v
}
