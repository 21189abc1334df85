package extender

import (
	"fmt"
	"math"
	"strings"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/ref"
)

// maxReasonRefs bounds how many missing references a filter reason names.
const maxReasonRefs = 3

// want is one reference a pod asks for, resolved once per request.
type want struct {
	ref ref.Ref
	// keys are the nodestate keys under which a node may hold it: its
	// canonical reference, and for a reference pinned by both tag and
	// digest also the digest alone (the kubelet lists an image by tag and by
	// digest separately).
	keys []string
	// total is its size in bytes as the cluster knows it, 0 if unknown.
	total int64
	// weight is its share of the pod's request: its size, or the mean size
	// of the others when no node knows its size.
	weight float64
}

// plan is a pod's request resolved against the cluster's knowledge: what to
// look up on each node and how much each reference weighs.
type plan struct {
	wants     []want
	sumWeight float64
}

// newPlan resolves req. total returns the cluster-wide size of a key (0 if
// unknown).
func newPlan(req podrequest.Request, total func(key string) int64) plan {
	var p plan
	var known float64
	nknown := 0
	for _, ref := range req.Refs() {
		w := want{ref: ref, keys: keysOf(ref)}
		for _, k := range w.keys {
			w.total = max(w.total, total(k))
		}
		if w.total > 0 {
			w.weight = float64(w.total)
			known += w.weight
			nknown++
		}
		p.wants = append(p.wants, w)
	}
	// A reference no node knows the size of counts as much as an average
	// one (or all count equally when no size is known).
	unknown := 1.0
	if nknown > 0 {
		unknown = known / float64(nknown)
	}
	for i := range p.wants {
		if p.wants[i].weight == 0 {
			p.wants[i].weight = unknown
		}
		p.sumWeight += p.wants[i].weight
	}
	return p
}

// keysOf is the nodestate keys a node may hold r under.
func keysOf(r ref.Ref) []string {
	keys := []string{nodestate.Key(r.String())}
	if r.Kind == ref.KindOCI && r.Digest != "" && r.Tag != "" {
		byDigest := r
		byDigest.Tag = ""
		keys = append(keys, nodestate.Key(byDigest.String()))
	}
	return keys
}

// find is what n holds of w: the best report under any of its keys.
func (w *want) find(n *nodeInfo) (holding, bool) {
	var best holding
	found := false
	for _, k := range w.keys {
		if h, ok := n.held[k]; ok {
			best = merge(best, h)
			found = true
		}
	}
	return best, found
}

// fraction is how much of w node n holds, 0 to 1.
func (w *want) fraction(n *nodeInfo) float64 {
	h, ok := w.find(n)
	switch {
	case !ok:
		return 0
	case h.ready:
		return 1
	case h.total > 0:
		return min(float64(h.bytes)/float64(h.total), 1)
	case w.total > 0:
		return min(float64(h.bytes)/float64(w.total), 1)
	}
	return 0
}

// fraction is the share of the pod's requested bytes that n holds, 0 to 1.
func (p *plan) fraction(n *nodeInfo) float64 {
	if n == nil || p.sumWeight == 0 {
		return 0
	}
	var held float64
	for i := range p.wants {
		held += p.wants[i].fraction(n) * p.wants[i].weight
	}
	return min(held/p.sumWeight, 1)
}

// score is n's extender score.
func (p *plan) score(n *nodeInfo) int64 { return scoreOf(p.fraction(n)) }

// scoreOf maps a held fraction to an extender score: 0 for nothing,
// MaxExtenderPriority (10) for everything, and in between the nearest of 1
// to 9, so that any progress ranks above none and only a complete node gets
// the top score.
func scoreOf(f float64) int64 {
	switch {
	case !(f > 0):
		return extenderv1.MinExtenderPriority
	case f >= 1:
		return extenderv1.MaxExtenderPriority
	}
	s := int64(math.Round(f * float64(extenderv1.MaxExtenderPriority)))
	return min(max(s, extenderv1.MinExtenderPriority+1), extenderv1.MaxExtenderPriority-1)
}

// missing says what n lacks to hold every reference ready, or "" when it
// holds them all. A nil node (one the extender does not know) lacks all.
func (p *plan) missing(n *nodeInfo) string {
	if n == nil {
		return "weightd: node not (yet) known to the extender; its cache state is unknown"
	}
	var parts []string
	lacking := 0
	for i := range p.wants {
		w := &p.wants[i]
		h, ok := w.find(n)
		if ok && h.ready {
			continue
		}
		if lacking++; lacking > maxReasonRefs {
			continue
		}
		state := "absent"
		if ok {
			if f := w.fraction(n); f > 0 {
				state = fmt.Sprintf("%.0f%%", math.Floor(f*100))
			} else {
				state = "fetching"
			}
		}
		parts = append(parts, fmt.Sprintf("%s (%s)", w.ref.Redacted(), state))
	}
	if lacking == 0 {
		return ""
	}
	msg := "weightd: not warm: " + strings.Join(parts, ", ")
	if more := lacking - len(parts); more > 0 {
		msg += fmt.Sprintf(" and %d more", more)
	}
	return msg
}
