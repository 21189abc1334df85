package warmpool

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// Eviction policies, the values of Config.Eviction.
const (
	// EvictLFU evicts the adapter of the fewest recent uses (see history),
	// the least recently used of those: the default.
	EvictLFU = "lfu"
	// EvictLRU evicts the least recently used adapter.
	EvictLRU = "lru"
)

// historyPerSlot is the window of uses, per slot of a base's servers, after
// which every count of its history is halved: TinyLFU's sample size of ten
// times the cache's capacity.
const historyPerSlot = 10

// history counts the uses of the adapters of one base, loaded or not, and
// halves every count each window uses (TinyLFU's reset). An adapter just
// evicted keeps its count, so a popular one wins its slot back from a
// newcomer used once; one popular long ago fades, so it loses to one popular
// now. Counts of 1 vanish at a halving, so it holds at most two windows of
// names: the counts add up to less than two windows.
type history struct {
	counts map[string]int
	since  int // uses since the last halving
}

// add counts a use of name; window is the base's slots times
// historyPerSlot.
func (h *history) add(name string, window int) {
	if h.counts == nil {
		h.counts = make(map[string]int)
	}
	h.counts[name]++
	h.since++
	if h.since < window {
		return
	}
	h.since = 0
	for n, c := range h.counts {
		if c /= 2; c == 0 {
			delete(h.counts, n)
		} else {
			h.counts[n] = c
		}
	}
}

// candidate is an evictable adapter as a policy sees it.
type candidate struct {
	name     string
	uses     int // its count in the base's history
	lastUsed time.Time
}

// evictsFirst reports whether policy evicts a before b. Under EvictLFU the
// fewer recent uses go first; equal counts, and EvictLRU, fall back to the
// least recently used; the name settles the rest, so that the choice never
// depends on the order of a map.
func evictsFirst(policy string, a, b candidate) bool {
	if policy == EvictLFU && a.uses != b.uses {
		return a.uses < b.uses
	}
	if !a.lastUsed.Equal(b.lastUsed) {
		return a.lastUsed.Before(b.lastUsed)
	}
	return a.name < b.name
}

// useLocked marks a, an adapter of base, used on behalf of owner (none when
// empty), pinned if pin, and counts the use in base's history.
func (p *Pool) useLocked(base string, a *adapter, owner string, pin bool) {
	a.lastUsed = time.Now()
	if owner != "" {
		if a.users == nil {
			a.users = make(map[string]struct{})
		}
		a.users[owner] = struct{}{}
	}
	if pin {
		a.pinned = true
	}
	h := p.history[base]
	if h == nil {
		h = &history{}
		p.history[base] = h
	}
	slots := 0
	for _, s := range p.servers {
		if s.spec.Base == base {
			slots += s.spec.Slots
		}
	}
	h.add(a.name, max(1, slots)*historyPerSlot)
}

func victimName(a *adapter) string {
	if a == nil {
		return ""
	}
	return a.name
}

// reserveLocked chooses a server of base that serves namespace for the
// adapter: a healthy one whose maximum rank allows it, with a free slot (the
// most free first), else the one holding the evictable adapter that
// Config.Eviction evicts first (the victim).
func (p *Pool) reserveLocked(base, namespace, name string, rank int) (*server, *adapter, error) {
	if s, a := p.adoptedLocked(base, namespace, name); a != nil {
		// Found loaded after a restart with other files: replace it in place.
		if !a.evictable() {
			return nil, nil, fmt.Errorf("%w: adapter %s on %s holds other weights and is in use", api.ErrBusy, name, s.spec.Pod)
		}
		return s, a, nil
	}
	var cands []*server
	maxRank := 0
	for _, s := range p.sortedLocked() {
		if s.spec.Base != base || !s.healthy || !s.synced || s.adapters[name] != nil || !s.spec.serves(namespace) {
			continue
		}
		if s.spec.MaxRank > 0 && rank > s.spec.MaxRank {
			maxRank = max(maxRank, s.spec.MaxRank)
			continue
		}
		cands = append(cands, s)
	}
	if len(cands) == 0 {
		if maxRank > 0 {
			return nil, nil, fmt.Errorf("%w: adapter %s has rank %d, over the maximum of the servers of %s (%d)", api.ErrBadRequest, name, rank, base, maxRank)
		}
		if err := p.baseServedLocked(base, namespace); err != nil {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("%w: no healthy warm server of base %s", api.ErrBusy, base)
	}
	var best *server
	for _, s := range cands {
		if free := s.spec.Slots - len(s.adapters); free > 0 && (best == nil || free > best.spec.Slots-len(best.adapters)) {
			best = s
		}
	}
	if best != nil {
		return best, nil, nil
	}
	var victim *adapter
	var first candidate
	h := p.history[base]
	for _, s := range cands {
		for _, a := range s.adapters {
			if !a.evictable() {
				continue
			}
			c := candidate{name: a.name, lastUsed: a.lastUsed}
			if h != nil {
				c.uses = h.counts[a.name]
			}
			if victim == nil || evictsFirst(p.cfg.Eviction, c, first) {
				best, victim, first = s, a, c
			}
		}
	}
	if victim == nil {
		return nil, nil, fmt.Errorf("%w: every adapter slot of the warm servers of %s holds an adapter that is pinned, in use or loading", api.ErrBusy, base)
	}
	return best, victim, nil
}

// runtimePinLocked reports whether s may be asked to pin one more adapter.
// SGLang refuses a pin once max_loras_per_batch − 1 adapters are pinned, so
// that one batch slot stays for the others and the base model
// (python/sglang/srt/lora/lora_manager.py, validate_new_adapter); Slots is
// that flag for SGLang. The pool's own pin still keeps an adapter loaded
// without it unevicted. vLLM has no pinning: the flag is ignored there.
func runtimePinLocked(s *server) bool {
	if s.spec.Runtime != engine.SGLang {
		return true
	}
	pinned := 0
	for _, a := range s.adapters {
		if a.runtimePinned {
			pinned++
		}
	}
	return pinned < s.spec.Slots-1
}

// adoptedLocked finds the adapter name that a healthy server of base serving
// namespace was found holding after a restart of the agent, whose reference
// is not known yet.
func (p *Pool) adoptedLocked(base, namespace, name string) (*server, *adapter) {
	for _, s := range p.sortedLocked() {
		if s.spec.Base != base || !s.healthy || !s.synced || !s.spec.serves(namespace) {
			continue
		}
		if a := s.adapters[name]; a != nil && !a.loading && a.ref == "" {
			return s, a
		}
	}
	return nil, nil
}

// evict unloads victim from s, whose slot the caller has taken over.
func (p *Pool) evict(ctx context.Context, s *server, victim *adapter) error {
	cctx, cancel := context.WithTimeout(ctx, p.cfg.CallTimeout)
	err := s.drv.Unload(cctx, victim.name)
	cancel()
	p.mu.Lock()
	p.seq++
	s.unloading[victim.name] = p.seq
	p.mu.Unlock()
	if err != nil && !errors.Is(err, engine.ErrNotLoaded) {
		p.kick()
		return fmt.Errorf("evicting adapter %s from %s: %w", victim.name, s.spec.Pod, err)
	}
	p.m.evictions.WithLabelValues(string(s.spec.Runtime)).Inc()
	p.log.Info("adapter evicted", "adapter", victim.name, "server", s.spec.Pod, "lastUsed", victim.lastUsed)
	p.unstage(victim.stage)
	return nil
}
