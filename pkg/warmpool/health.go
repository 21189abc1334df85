package warmpool

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/weightd/weightd/pkg/lora"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// Run checks every warm server each HealthInterval, and at once after
// SetServers or a failed runtime call, until ctx ends; it always returns
// nil then. A check asks the server's health and the adapters it lists:
// adapters it lists that the pool did not know are adopted (after a restart
// of the agent), and adapters the pool loaded that it no longer lists (the
// server restarted) are loaded again when pinned or in use, forgotten
// otherwise. Run also keeps the base model of each healthy server through
// Bases, and drops it when the server stops answering: a pod that only
// claims to be a warm server pins nothing in the node's cache.
func (p *Pool) Run(ctx context.Context) error {
	var keeps sync.WaitGroup
	defer keeps.Wait()
	t := time.NewTicker(p.cfg.HealthInterval)
	defer t.Stop()
	for {
		p.startKeeps(ctx, &keeps)
		p.checkAll(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-p.wake:
		}
	}
}

// startKeeps calls Bases.Keep, in the background, for each healthy server
// whose base is not kept yet.
func (p *Pool) startKeeps(ctx context.Context, wg *sync.WaitGroup) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range p.servers {
		if s.kept || s.keeping || !s.healthy {
			continue
		}
		s.keeping = true
		wg.Go(func() {
			err := p.cfg.Bases.Keep(ctx, s.spec)
			p.mu.Lock()
			s.keeping, s.kept = false, err == nil && s.healthy
			gone := p.servers[s.spec.Pod] != s // removed, or replaced by a new spec
			unhealthy := err == nil && !s.healthy
			p.mu.Unlock()
			if gone || unhealthy {
				// Removed, replaced or found unhealthy while its base was
				// being kept: SetServers and check drop only kept bases,
				// so undo what Keep did here.
				p.cfg.Bases.Drop(s.spec)
				return
			}
			if err != nil && ctx.Err() == nil {
				p.log.Warn("keeping the base model of a warm server; trying again at the next check", "pod", s.spec.Pod, "base", s.spec.Base, "err", err)
			}
		})
	}
}

// checkAll checks every server at once and waits for the checks.
func (p *Pool) checkAll(ctx context.Context) {
	p.mu.Lock()
	servers := p.sortedLocked()
	p.mu.Unlock()
	var wg sync.WaitGroup
	for _, s := range servers {
		wg.Go(func() { p.check(ctx, s) })
	}
	wg.Wait()
}

// check asks s for its health and adapters, reconciles the pool's books
// with the answer and loads again what s lost and is still needed.
func (p *Pool) check(ctx context.Context, s *server) {
	cctx, cancel := context.WithTimeout(ctx, p.cfg.CallTimeout)
	p.mu.Lock()
	before := p.seq
	p.mu.Unlock()
	err := s.drv.Health(cctx)
	var list []engine.Adapter
	if err == nil {
		list, err = s.drv.Adapters(cctx)
	}
	cancel()
	if ctx.Err() != nil {
		return
	}
	var gpus []string
	var gpuMem uint64
	if p.cfg.GPUUse != nil && s.spec.UID != "" {
		gpus, gpuMem = p.cfg.GPUUse(s.spec.UID)
	}

	p.mu.Lock()
	if p.servers[s.spec.Pod] != s {
		p.mu.Unlock()
		return // removed or replaced meanwhile
	}
	s.gpus, s.gpuMem = gpus, gpuMem
	if err != nil {
		if s.healthy || !s.synced || s.err == "" {
			p.log.Warn("warm server unhealthy", "pod", s.spec.Pod, "err", err)
		}
		s.healthy, s.err = false, err.Error()
		drop := s.kept
		s.kept = false
		p.notifyLocked()
		p.mu.Unlock()
		if drop {
			p.cfg.Bases.Drop(s.spec)
		}
		return
	}
	if !s.healthy {
		p.log.Info("warm server healthy", "pod", s.spec.Pod, "adapters", len(list))
		p.kick() // keep its base now, not at the next interval
	}
	s.healthy, s.err = true, ""
	listed := make(map[string]bool, len(list))
	for _, a := range list {
		listed[a.Name] = true
		if end, ok := s.unloading[a.Name]; s.adapters[a.Name] != nil || !engine.ValidAdapterName(a.Name) || ok && (end == 0 || end > before) {
			continue
		}
		// Loaded by an earlier agent (or by hand): adopt it.
		p.seq++
		found := &adapter{name: a.Name, seq: p.seq, lastUsed: time.Now()}
		if digest := stageDigestOf(p.cfg.ServerStageDir, a.Name, a.Path); digest != "" {
			found.stage = stageName(a.Name, digest)
		}
		s.adapters[a.Name] = found
		p.log.Info("adapter found loaded", "adapter", a.Name, "server", s.spec.Pod)
	}
	for name, end := range s.unloading {
		if end != 0 && end <= before {
			delete(s.unloading, name)
		}
	}
	var reload []*adapter
	var flights []*flight
	for name, a := range s.adapters {
		if a.loading || listed[name] || a.seq > before {
			continue
		}
		if a.pinned || len(a.users) > 0 {
			a.loading = true
			reload = append(reload, a)
			if key := flightKey(s.spec.Base, name); p.flights[key] == nil {
				f := &flight{done: make(chan struct{})}
				p.flights[key] = f
				flights = append(flights, f)
			} else {
				flights = append(flights, nil)
			}
			continue
		}
		delete(s.adapters, name)
		p.log.Info("adapter lost by its server (restarted?); forgotten, not in use", "adapter", name, "server", s.spec.Pod)
	}
	s.synced = true
	p.notifyLocked()
	p.mu.Unlock()

	for i, a := range reload {
		err := p.reload(ctx, s, a)
		p.mu.Lock()
		if f := flights[i]; f != nil {
			// Ensures waiting on it look again (and load it themselves if
			// this failed).
			delete(p.flights, flightKey(s.spec.Base, a.name))
			close(f.done)
		}
		if s.adapters[a.name] == a {
			if err != nil {
				delete(s.adapters, a.name)
			} else {
				p.seq++
				a.loading, a.seq = false, p.seq
			}
		}
		p.notifyLocked()
		p.mu.Unlock()
		if err != nil {
			p.log.Warn("loading again an adapter in use that its server lost", "adapter", a.name, "server", s.spec.Pod, "err", err)
		} else {
			p.log.Info("adapter in use loaded again after its server lost it", "adapter", a.name, "server", s.spec.Pod)
		}
	}
}

// reload loads a again into s from its staged directory, staging it anew
// when the directory is gone and its reference is known.
func (p *Pool) reload(ctx context.Context, s *server, a *adapter) error {
	p.mu.Lock()
	stage, ref := a.stage, a.ref
	p.mu.Unlock()
	if _, err := os.Stat(filepath.Join(p.cfg.StageDir, stage)); stage == "" || err != nil {
		if ref == "" {
			return fmt.Errorf("adapter %s: not staged and its reference is unknown", a.name)
		}
		dir, err := p.cfg.Fetcher.Fetch(ctx, ref)
		if err != nil {
			return fmt.Errorf("fetching adapter %s: %w", ref, err)
		}
		if _, err := lora.Inspect(dir); err != nil {
			return fmt.Errorf("checking adapter %s: %w", ref, err)
		}
		digest, err := contentDigest(dir)
		if err != nil {
			return fmt.Errorf("fetching adapter %s: %w", ref, err)
		}
		stage = stageName(a.name, digest)
		if err := p.stageOnce(stage, dir); err != nil {
			return err
		}
		p.mu.Lock()
		a.stage = stage
		p.mu.Unlock()
	}
	outcome, err := p.loadInto(ctx, s, a.name, stage, a.runtimePinned)
	if err != nil {
		p.m.loads.WithLabelValues(string(s.spec.Runtime), outcome).Inc()
		return err
	}
	p.m.loads.WithLabelValues(string(s.spec.Runtime), outcomeOK).Inc()
	p.m.reloads.WithLabelValues(string(s.spec.Runtime)).Inc()
	return nil
}
