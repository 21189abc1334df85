package hf

import "sync"

// recent is a map by repo@commit that holds at most limit entries' worth
// (each entry weighs what add says), oldest forgotten first, safe for
// concurrent use.
type recent[V any] struct {
	limit int

	mu     sync.Mutex
	m      map[string]V
	order  []string
	weight map[string]int
	total  int
}

// add remembers v, of weight w, under k, unless k is known already.
func (c *recent[V]) add(k string, v V, w int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[k]; ok || w > c.limit {
		return
	}
	if c.m == nil {
		c.m, c.weight = make(map[string]V), make(map[string]int)
	}
	c.m[k], c.weight[k] = v, w
	c.order = append(c.order, k)
	for c.total += w; c.total > c.limit; c.order = c.order[1:] {
		c.total -= c.weight[c.order[0]]
		delete(c.m, c.order[0])
		delete(c.weight, c.order[0])
	}
}

func (c *recent[V]) get(k string) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v, ok := c.m[k]
	return v, ok
}
