package policy

import (
	"fmt"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

// Matches reports whether sel selects a node with the given labels. A nil
// selector selects no node, an empty one every node. A selector that does
// not parse (the CRD's schema lets few through) is an error.
func Matches(sel *metav1.LabelSelector, nodeLabels map[string]string) (bool, error) {
	if sel == nil {
		return false, nil
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return false, fmt.Errorf("parsing node selector: %w", err)
	}
	return s.Matches(labels.Set(nodeLabels)), nil
}

// Want is one reference a policy names, parsed.
type Want struct {
	// Ref is the canonical reference to submit; empty when Err is set.
	Ref string
	// Shown is how the status names it: canonical with any query
	// redacted, or for a malformed one, what the policy says, redacted
	// and cut.
	Shown string
	// Image is true for an entry of spec.images.
	Image bool
	// Err is why the reference is malformed.
	Err error
}

// Wants parses the models and images of a policy, in order, without
// duplicates (by canonical reference). Malformed ones are returned with
// their error, not dropped, so that the status can say why.
func Wants(s Spec) []Want {
	var out []Want
	seen := make(map[string]bool)
	add := func(raw string, image bool, r ref.Ref, err error) {
		if err != nil {
			out = append(out, Want{Shown: redactRaw(raw), Image: image, Err: redactErr(err, raw)})
			return
		}
		c := r.String()
		if seen[c] {
			return
		}
		seen[c] = true
		out = append(out, Want{Ref: c, Shown: cut(r.Redacted(), MaxRefLen), Image: image})
	}
	for _, m := range s.Models {
		r, err := ref.Parse(m)
		add(m, false, r, err)
	}
	for _, img := range s.Images {
		r, err := podrequest.ImageRef(img)
		if err != nil {
			err = fmt.Errorf("parsing image %q: %w", cut(redactRaw(img), 120), err)
		}
		add(img, true, r, err)
	}
	return out
}

// redactRaw hides the query of a reference that did not parse (presigned
// URLs carry credentials there) and bounds its length.
func redactRaw(s string) string {
	if before, _, ok := strings.Cut(s, "?"); ok {
		s = before + "?REDACTED"
	}
	return cut(s, MaxRefLen)
}

// redactErr hides the query of raw where err's message quotes it (parse
// errors quote the first 120 bytes of the reference).
func redactErr(err error, raw string) error {
	if !strings.Contains(raw, "?") {
		return err
	}
	msg := err.Error()
	for _, n := range []int{len(raw), 120} {
		if n <= len(raw) {
			msg = strings.ReplaceAll(msg, raw[:n], redactRaw(raw))
		}
	}
	if msg == err.Error() && strings.Contains(msg, "?") {
		msg = "malformed reference " + redactRaw(raw) // say less rather than leak
	}
	return redactedError{msg: msg, err: err}
}

type redactedError struct {
	msg string
	err error
}

func (e redactedError) Error() string { return e.msg }
func (e redactedError) Unwrap() error { return e.err }

// cut bounds s to n bytes, without splitting a UTF-8 sequence.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const ellipsis = "…"
	i := n - len(ellipsis)
	for i > 0 && s[i]&0xC0 == 0x80 {
		i--
	}
	return s[:i] + ellipsis
}

// RefState is where one wanted reference is on this node.
type RefState struct {
	// Shown is the reference as the status names it (Want.Shown).
	Shown string
	// State is the job's state; a reference that could not be submitted
	// is StateFailed.
	State prefetch.JobState
	// Bytes of it held on the node.
	Bytes int64
	// Reason is why it failed.
	Reason string
}

// BuildEntry makes node's status for a policy at generation gen from
// the states of its references, in the policy's order.
func BuildEntry(node string, gen int64, refs []RefState, now time.Time) NodeStatus {
	e := NodeStatus{Name: node, ObservedGeneration: gen, Updated: metav1.NewTime(now.UTC().Truncate(time.Second))}
	for _, r := range refs {
		e.Bytes += max(r.Bytes, 0)
		switch r.State {
		case prefetch.StateReady:
			e.Ready = append(e.Ready, r.Shown)
		case prefetch.StateFailed:
			e.Failed = append(e.Failed, Failure{Ref: r.Shown, Reason: cut(r.Reason, MaxReasonLen)})
		default:
			e.Fetching = append(e.Fetching, r.Shown)
		}
	}
	e.ReadyCount, e.FailedCount = int32(len(e.Ready)), int32(len(e.Failed))
	switch {
	case len(e.Failed) > 0:
		e.State = NodeFailed
	case len(e.Fetching) > 0:
		e.State = NodeFetching
	default:
		e.State = NodeReady
	}
	return e
}

// sameEntry reports whether two entries say the same, whenever written.
func sameEntry(a, b NodeStatus) bool {
	return a.Name == b.Name && a.State == b.State && a.Bytes == b.Bytes &&
		a.ObservedGeneration == b.ObservedGeneration &&
		slices.Equal(a.Ready, b.Ready) && slices.Equal(a.Fetching, b.Fetching) && slices.Equal(a.Failed, b.Failed)
}
