package policy

import (
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
)

// recordFailures records a Warning Event on the policy for each failure of
// this node's entry not reported yet with the same reason.
func (c *Controller) recordFailures(u *unstructured.Unstructured, name string, wants []Want, e NodeStatus) {
	invalid := make(map[string]bool)
	for _, w := range wants {
		if w.Err != nil {
			invalid[w.Shown] = true
		}
	}
	prev := c.reported[name]
	next := make(map[string]string, len(e.Failed))
	for _, f := range e.Failed {
		next[f.Ref] = f.Reason
		if prev[f.Ref] == f.Reason {
			continue
		}
		reason := ReasonFailed
		if invalid[f.Ref] {
			reason = ReasonInvalid
		}
		c.rec.Eventf(u, corev1.EventTypeWarning, reason, "node %s: %s: %s", c.node, cut(f.Ref, 256), f.Reason)
	}
	c.reported[name] = next
}

// writeEntry applies this node's status of a policy to its
// PrefetchPolicyNode, unless it was written already; at most once per
// Debounce. The agent does not watch the object: what it wrote last is what
// is there (another writer would be refused by the admission policy).
func (c *Controller) writeEntry(p *PrefetchPolicy, e NodeStatus, now time.Time) error {
	name := p.Name
	delete(c.cleared, name)
	if w, ok := c.written[name]; ok && w.uid == p.UID && sameEntry(w.entry, e) {
		return nil
	}
	if wait := c.lastWrite[name].Add(c.cfg.Debounce).Sub(now); wait > 0 {
		c.queue.AddAfter(item{name: name}, wait)
		return nil
	}
	obj, err := NodeStatusObject(p, e)
	if err != nil {
		return err
	}
	_, err = c.dyn.Resource(NodeGVR).Apply(c.ctx, obj.GetName(), obj, metav1.ApplyOptions{FieldManager: FieldManager(c.node), Force: true})
	c.countWrite("entry", err)
	if err != nil {
		return fmt.Errorf("applying the status of node %s on policy %s: %w", c.node, name, err)
	}
	c.written[name] = writtenStatus{uid: p.UID, entry: e}
	c.lastWrite[name] = now
	c.log.Debug("policy status written", "policy", name, "state", e.State, "ready", len(e.Ready), "fetching", len(e.Fetching), "failed", len(e.Failed))
	return nil
}

// writtenStatus is what the controller last applied for a policy.
type writtenStatus struct {
	uid   types.UID // of the policy
	entry NodeStatus
}

// removeEntry deletes this node's PrefetchPolicyNode of a policy that no
// longer selects it: once per agent run (it may have been written before a
// restart), then only after a write.
func (c *Controller) removeEntry(p *PrefetchPolicy) error {
	name := p.Name
	if c.cleared[name] {
		return nil
	}
	err := DeleteNodeStatus(c.ctx, c.dyn, name, c.node)
	c.countWrite("remove", err)
	if err != nil {
		return err
	}
	if _, ok := c.written[name]; ok {
		c.log.Info("node no longer selected: status removed", "policy", name)
	}
	delete(c.written, name)
	c.cleared[name] = true
	return nil
}

// countWrite counts a write to the API server of kind in the metrics.
func (c *Controller) countWrite(kind string, err error) {
	outcome := "ok"
	if err != nil {
		outcome = "error"
	}
	c.m.writes.WithLabelValues(kind, outcome).Inc()
}

// NodeStatusObject is the server-side apply configuration of the
// PrefetchPolicyNode of e's node on policy p: its name, labels, owner (p,
// so that it is deleted with p) and status e.
func NodeStatusObject(p *PrefetchPolicy, e NodeStatus) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&e)
	if err != nil {
		return nil, fmt.Errorf("converting the status of node %s on policy %s: %w", e.Name, p.Name, err)
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": APIVersion,
		"kind":       NodeKind,
		"metadata": map[string]any{
			"name":   NodeObjectName(p.Name, e.Name),
			"labels": map[string]any{PolicyLabel: LabelValue(p.Name), NodeLabel: LabelValue(e.Name)},
			"ownerReferences": []any{map[string]any{
				"apiVersion": APIVersion, "kind": Kind, "name": p.Name, "uid": string(p.UID),
			}},
		},
		"status": m,
	}}, nil
}

// stripManagedFields is the informers' transform: managed fields are of no
// use here.
func stripManagedFields(obj any) (any, error) {
	if u, ok := obj.(*unstructured.Unstructured); ok {
		u.SetManagedFields(nil)
	}
	return obj, nil
}

// nodeLabelsOnly is the node informer's transform: only the name and
// labels matter.
func nodeLabelsOnly(obj any) (any, error) {
	if n, ok := obj.(*corev1.Node); ok {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{
			Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion, Labels: n.Labels,
		}}, nil
	}
	return obj, nil
}
