package policy

import (
	"fmt"
	"reflect"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
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

// writeEntry applies this node's entry to the policy's status, unless the
// status already says the same; at most once per Debounce.
func (c *Controller) writeEntry(p *PrefetchPolicy, e NodeStatus, now time.Time) error {
	name := p.Name
	if cur, ok := p.Status.Entry(c.node); ok && sameEntry(cur, e) {
		c.written[name] = &e
		return nil
	}
	if w := c.written[name]; w != nil && sameEntry(*w, e) {
		// Written, and the informer has not caught up yet: look again
		// once it should have.
		if since := now.Sub(c.lastWrite[name]); since < 4*c.cfg.Debounce {
			c.queue.AddAfter(item{name: name}, 4*c.cfg.Debounce-since)
			return nil
		}
	}
	if wait := c.lastWrite[name].Add(c.cfg.Debounce).Sub(now); wait > 0 {
		c.queue.AddAfter(item{name: name}, wait)
		return nil
	}
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&e)
	if err != nil {
		return fmt.Errorf("converting the status entry: %w", err)
	}
	obj := applyObject(name, map[string]any{"nodes": []any{m}})
	if err := c.apply(obj, FieldManager(c.node), "entry"); err != nil {
		return err
	}
	c.written[name] = &e
	c.lastWrite[name] = now
	c.log.Debug("policy status written", "policy", name, "state", e.State, "ready", len(e.Ready), "fetching", len(e.Fetching), "failed", len(e.Failed))
	return nil
}

// removeEntry takes this node's entry out of the policy's status, if it is
// there: an apply that no longer names it.
func (c *Controller) removeEntry(p *PrefetchPolicy) error {
	name := p.Name
	_, there := p.Status.Entry(c.node)
	if !there && c.written[name] == nil {
		return nil
	}
	if err := c.apply(applyObject(name, nil), FieldManager(c.node), "remove"); err != nil {
		return err
	}
	c.log.Info("node no longer selected: status entry removed", "policy", name)
	delete(c.written, name)
	c.lastWrite[name] = time.Now()
	others := slices.DeleteFunc(slices.Clone(p.Status.Nodes), func(n NodeStatus) bool { return n.Name == c.node })
	if len(others) == 0 {
		// The last node out zeroes the counts: no entry is left to rank
		// the agents that would correct them. (An apply that changes
		// nothing does not write.)
		return c.apply(applyObject(name, countsMap(0, 0, 0)), SummaryFieldManager, "counts")
	}
	return nil
}

// counts checks the policy's status counts against its entries. A check
// that finds them wrong schedules a fix after this node's rank delay; a fix
// writes them if they are still wrong.
func (c *Controller) counts(name string, fix bool) error {
	p, _, err := c.policy(name)
	if err != nil || p == nil {
		return err
	}
	n, r, f := Counts(p.Status.Nodes, p.Generation)
	if n == p.Status.NodeCount && r == p.Status.ReadyNodes && f == p.Status.FailedNodes {
		return nil
	}
	if fix {
		return c.apply(applyObject(name, countsMap(n, r, f)), SummaryFieldManager, "counts")
	}
	rank := slices.IndexFunc(sortedNames(p.Status.Nodes), func(s string) bool { return s == c.node })
	if rank < 0 || rank >= c.cfg.SummaryRanks {
		return nil
	}
	c.queue.AddAfter(item{name: name, kind: fixCounts}, time.Duration(rank+1)*c.cfg.SummaryDelay)
	return nil
}

func sortedNames(nodes []NodeStatus) []string {
	names := make([]string, len(nodes))
	for i, n := range nodes {
		names[i] = n.Name
	}
	slices.Sort(names)
	return names
}

func countsMap(n, r, f int32) map[string]any {
	return map[string]any{"nodeCount": int64(n), "readyNodes": int64(r), "failedNodes": int64(f)}
}

// applyObject is a server-side apply configuration of a policy's status.
func applyObject(name string, status map[string]any) *unstructured.Unstructured {
	obj := map[string]any{
		"apiVersion": APIVersion,
		"kind":       Kind,
		"metadata":   map[string]any{"name": name},
	}
	if status != nil {
		obj["status"] = status
	}
	return &unstructured.Unstructured{Object: obj}
}

// apply applies obj to the status subresource as manager; kind names the
// write in the metrics. A policy deleted meanwhile is not an error.
func (c *Controller) apply(obj *unstructured.Unstructured, manager, kind string) error {
	_, err := c.dyn.Resource(GVR).ApplyStatus(c.ctx, obj.GetName(), obj, metav1.ApplyOptions{FieldManager: manager, Force: true})
	outcome := "ok"
	if err != nil && !apierrors.IsNotFound(err) {
		outcome = "error"
	}
	c.m.writes.WithLabelValues(kind, outcome).Inc()
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("applying the status of policy %s: %w", obj.GetName(), err)
	}
	return nil
}

// equalOwnEntry reports whether node's status entry is the same in a and b.
func equalOwnEntry(a, b *unstructured.Unstructured, node string) bool {
	ea, oka := rawEntry(a, node)
	eb, okb := rawEntry(b, node)
	return oka == okb && (!oka || reflect.DeepEqual(ea, eb))
}

func rawEntry(u *unstructured.Unstructured, node string) (map[string]any, bool) {
	nodes, _, _ := unstructured.NestedSlice(u.Object, "status", "nodes")
	for _, n := range nodes {
		if m, ok := n.(map[string]any); ok && m["name"] == node {
			return m, true
		}
	}
	return nil, false
}

// stripManagedFields is the policy informer's transform: the managed fields
// of a policy that a thousand nodes write are large and of no use here.
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
