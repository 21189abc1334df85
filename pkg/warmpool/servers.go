package warmpool

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// ServerSpec is a warm server as discovery (pod labels and annotations)
// describes it.
type ServerSpec struct {
	// Pod is the server pod's namespace/name; UID its uid.
	Pod string
	UID string
	// Base is the reference of the base model the server keeps resident
	// (hf://…, oci://…, https://…).
	Base    string
	Runtime engine.Kind
	// Endpoint is the server's base URL, http://ip:port.
	Endpoint string
	// Slots is the most adapters the server holds at once (vLLM
	// --max-loras, SGLang --max-loras-per-batch). vLLM would take more
	// (evicting from its caches) and SGLang up to --max-loaded-loras, but
	// past these an adapter is no longer resident on the GPU: the pool
	// holds no more. For SGLang it also bounds the runtime pins to Slots−1.
	Slots int
	// MaxRank is the largest LoRA rank the server takes (vLLM
	// --max-lora-rank); 0 when unknown.
	MaxRank int
	// Shared servers take adapters for pods of every namespace; the others
	// only for pods of their own (api.AdapterRequest.Namespace).
	Shared bool
}

// serves reports whether s may take adapters for pods of namespace ("":
// the node's operator, who may use any server).
func (s ServerSpec) serves(namespace string) bool {
	if namespace == "" || s.Shared {
		return true
	}
	ns, _, _ := strings.Cut(s.Pod, "/")
	return ns == namespace
}

// SetServers replaces the set of warm servers, as discovery found them. A
// new server is listed (its adapters adopted: after a restart of the agent
// nothing is lost) and its base kept by Run; a server gone, or whose spec
// changed, is forgotten and its base dropped if kept (a base found down
// was dropped then, and one being kept is dropped once Keep returns).
// Invalid specs are logged and skipped.
func (p *Pool) SetServers(specs []ServerSpec) {
	var dropped []ServerSpec
	added := false
	p.mu.Lock()
	seen := make(map[string]bool, len(specs))
	for _, spec := range specs {
		if err := validSpec(spec); err != nil {
			p.log.Warn("ignoring warm server", "pod", spec.Pod, "err", err)
			continue
		}
		seen[spec.Pod] = true
		old := p.servers[spec.Pod]
		if old != nil && old.spec == spec {
			continue
		}
		drv, err := p.cfg.Drivers(spec.Runtime, spec.Endpoint)
		if err != nil {
			p.log.Warn("ignoring warm server", "pod", spec.Pod, "err", err)
			delete(seen, spec.Pod)
			continue
		}
		if old != nil && old.kept {
			dropped = append(dropped, old.spec)
		}
		added = true
		p.servers[spec.Pod] = &server{spec: spec, drv: drv, adapters: make(map[string]*adapter), unloading: make(map[string]uint64)}
		p.log.Info("warm server added", "pod", spec.Pod, "base", spec.Base, "runtime", spec.Runtime, "endpoint", spec.Endpoint, "slots", spec.Slots)
	}
	for pod, s := range p.servers {
		if !seen[pod] {
			delete(p.servers, pod)
			if s.kept {
				dropped = append(dropped, s.spec)
			}
			p.log.Info("warm server removed", "pod", pod, "base", s.spec.Base)
		}
	}
	// A base no server serves any more forgets its adapters' uses.
	bases := make(map[string]bool, len(p.servers))
	for _, s := range p.servers {
		bases[s.spec.Base] = true
	}
	for base := range p.history {
		if !bases[base] {
			delete(p.history, base)
		}
	}
	if !added && len(dropped) == 0 {
		p.mu.Unlock()
		return
	}
	p.notifyLocked()
	p.mu.Unlock()
	for _, s := range dropped {
		p.cfg.Bases.Drop(s)
	}
	p.kick()
}

func validSpec(s ServerSpec) error {
	switch {
	case s.Pod == "":
		return errors.New("no pod name")
	case s.Base == "":
		return errors.New("no base model")
	case s.Endpoint == "":
		return errors.New("no endpoint")
	case s.Slots < 1:
		return fmt.Errorf("%d adapter slots", s.Slots)
	case s.MaxRank < 0:
		return fmt.Errorf("max rank %d", s.MaxRank)
	}
	return nil
}

// Servers describes the warm servers and their loaded adapters, sorted by
// pod.
func (p *Pool) Servers() []api.WarmServer {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]api.WarmServer, 0, len(p.servers))
	for _, s := range p.servers {
		ws := api.WarmServer{
			Pod: s.spec.Pod, Base: s.spec.Base, Runtime: string(s.spec.Runtime), Endpoint: s.spec.Endpoint,
			Healthy: s.healthy, Error: s.err, Slots: s.spec.Slots, GPUs: slices.Clone(s.gpus),
			Adapters: []api.LoadedAdapter{},
		}
		for _, a := range s.adapters {
			if a.loading {
				continue
			}
			ws.Adapters = append(ws.Adapters, api.LoadedAdapter{
				Name: a.name, Ref: a.ref, LastUsed: a.lastUsed, Pinned: a.pinned, InUse: len(a.users),
			})
		}
		slices.SortFunc(ws.Adapters, func(a, b api.LoadedAdapter) int { return cmp.Compare(a.Name, b.Name) })
		out = append(out, ws)
	}
	slices.SortFunc(out, func(a, b api.WarmServer) int { return cmp.Compare(a.Pod, b.Pod) })
	return out
}

func (p *Pool) sortedLocked() []*server {
	out := make([]*server, 0, len(p.servers))
	for _, s := range p.servers {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *server) int { return cmp.Compare(a.spec.Pod, b.spec.Pod) })
	return out
}
