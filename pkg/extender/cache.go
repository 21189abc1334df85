package extender

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"

	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

// Bounds on what one node contributes, whatever its object says.
const (
	// maxImageNames bounds the image names read from one node's
	// status.images (the kubelet reports 50 images by default).
	maxImageNames = 4096
	// maxLabels bounds the weightd labels read from one node.
	maxLabels = 4096
)

// holding is what a node holds of one model or image.
type holding struct {
	// bytes present of total; total is 0 when the node does not know it.
	bytes, total int64
	// ready: the node holds it complete and verified.
	ready bool
}

// merge combines two reports about the same content (a label and a summary
// entry, or two image names): ready if either says so, bytes and total from
// the more informed one.
func merge(a, b holding) holding {
	out := a
	out.ready = a.ready || b.ready
	if b.total > a.total || (b.total == a.total && b.bytes > a.bytes) {
		out.bytes, out.total = b.bytes, b.total
	}
	return out
}

// nodeInfo is one node's cache state, computed once per change of the node
// and read by every request. It is immutable once built.
type nodeInfo struct {
	name            string
	resourceVersion string
	// held maps nodestate keys to what the node holds: from its ready
	// labels, its summary annotation and its status.images.
	held map[string]holding
}

// nodeFields are the parts of a Node the extender reads, whether they come
// from a typed object (the informer) or from the wire (nodes mode).
type nodeFields struct {
	name, resourceVersion string
	labels, annotations   map[string]string
	images                []corev1.ContainerImage
}

func fieldsOf(n *corev1.Node) nodeFields {
	return nodeFields{
		name:            n.Name,
		resourceVersion: n.ResourceVersion,
		labels:          n.Labels,
		annotations:     n.Annotations,
		images:          n.Status.Images,
	}
}

// newNodeInfo computes a node's state. The error says what of the node was
// ignored (a malformed summary annotation); the state is usable either way.
func newNodeInfo(f nodeFields) (*nodeInfo, error) {
	info := &nodeInfo{name: f.name, resourceVersion: f.resourceVersion, held: make(map[string]holding)}
	add := func(key string, h holding) {
		if old, ok := info.held[key]; ok {
			h = merge(old, h)
		}
		info.held[key] = h
	}
	n := 0
	for k, v := range f.labels {
		key, ok := strings.CutPrefix(k, nodestate.LabelPrefix)
		if !ok || v != nodestate.LabelReady || key == "" {
			continue
		}
		if n++; n > maxLabels {
			break
		}
		add(key, holding{ready: true})
	}
	var err error
	if s, ok := f.annotations[nodestate.SummaryAnnotation]; ok {
		sum, derr := nodestate.Decode(s)
		if derr != nil {
			err = fmt.Errorf("node %s: ignoring its cache summary: %w", f.name, derr)
		}
		for _, e := range sum.Entries {
			if e.Key == "" {
				continue
			}
			add(e.Key, holding{bytes: e.Bytes, total: e.Total, ready: e.State == nodestate.StateReady})
		}
	}
	n = 0
	for _, img := range f.images {
		if img.SizeBytes < 0 {
			continue
		}
		for _, name := range img.Names {
			if n++; n > maxImageNames {
				break
			}
			ref, perr := podrequest.ImageRef(name)
			if perr != nil {
				continue // image IDs and names the kubelet could not name
			}
			add(nodestate.Key(ref.String()), holding{bytes: img.SizeBytes, total: img.SizeBytes, ready: true})
		}
	}
	return info, err
}

// Cache is the extender's view of the cluster's nodes: each node's cache
// state, computed when the node changes, and what the whole cluster knows of
// each model's size. A Watcher keeps it current; tests and benchmarks may
// feed it directly. It is safe for concurrent use.
type Cache struct {
	mu    sync.RWMutex
	nodes map[string]*nodeInfo
	// totals counts, per key, the nodes reporting each total size, so the
	// size of a model is known while any node knows it.
	totals map[string]map[int64]int
}

// NewCache returns an empty cache.
func NewCache() *Cache {
	return &Cache{nodes: make(map[string]*nodeInfo), totals: make(map[string]map[int64]int)}
}

// Set stores the state of node, replacing what was known of it. A node whose
// resource version is unchanged is not recomputed. The node is stored even
// when Set returns an error: the error says what of it was ignored (a
// malformed summary annotation).
func (c *Cache) Set(node *corev1.Node) error {
	if node == nil || node.Name == "" {
		return errors.New("node without a name")
	}
	c.mu.RLock()
	old := c.nodes[node.Name]
	c.mu.RUnlock()
	if old != nil && node.ResourceVersion != "" && old.resourceVersion == node.ResourceVersion {
		return nil
	}
	info, err := newNodeInfo(fieldsOf(node))
	c.mu.Lock()
	c.replace(node.Name, info)
	c.mu.Unlock()
	return err
}

// Delete forgets the node called name.
func (c *Cache) Delete(name string) {
	c.mu.Lock()
	c.replace(name, nil)
	c.mu.Unlock()
}

// Len is the number of nodes known.
func (c *Cache) Len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.nodes)
}

// replace swaps a node's state (nil deletes it) and keeps the totals in
// step. The caller holds c.mu for writing.
func (c *Cache) replace(name string, info *nodeInfo) {
	if old := c.nodes[name]; old != nil {
		for key, h := range old.held {
			if h.total <= 0 {
				continue
			}
			m := c.totals[key]
			if m[h.total]--; m[h.total] <= 0 {
				delete(m, h.total)
			}
			if len(m) == 0 {
				delete(c.totals, key)
			}
		}
	}
	if info == nil {
		delete(c.nodes, name)
		return
	}
	c.nodes[name] = info
	for key, h := range info.held {
		if h.total <= 0 {
			continue
		}
		m := c.totals[key]
		if m == nil {
			m = make(map[int64]int, 1)
			c.totals[key] = m
		}
		m[h.total]++
	}
}

// total is the size of the content under key as the cluster knows it (the
// largest size any node reports; they agree unless the content changed), or
// 0. The caller holds c.mu for reading.
func (c *Cache) total(key string) int64 {
	var max int64
	for t := range c.totals[key] {
		if t > max {
			max = t
		}
	}
	return max
}
