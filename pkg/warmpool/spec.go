// Package warmpool keeps LoRA adapters hot-swapped into warm inference
// servers: servers on this node that keep a base model resident in GPU
// memory. It chooses a server for each adapter, fetches and stages the
// adapter, loads it through the runtime's API (package engine), evicts the
// least recently used adapter when a server's slots are full, and rebuilds
// its state from the servers after a restart of the agent or of a server.
//
// A Pool is fed its servers by discovery (SetServers) and answers
// Ensure(base, adapter) from the local API (it implements api.Adapters) and
// EnsureFor on behalf of a pod, whose use keeps the adapter loaded until
// Release. An ensure finds the adapter loaded on a server of the base, else
// fetches it (Fetcher: the cache and swarm), checks its files (lora.Inspect:
// config, safetensors header, rank against the server's maximum) before any
// runtime sees it, reserves a slot (a free one, else the least recently used
// adapter neither pinned nor in use is unloaded), stages it under StageDir
// (hard links into the cache, renamed into place whole), loads it and checks
// that the server lists it. Concurrent ensures of one adapter share one
// load. Run checks the servers' health and listings, adopts what they hold
// after a restart of the agent and loads again, after a restart of a server,
// the adapters still pinned or in use.
//
// Metrics: weightd_warmpool_servers{runtime,state},
// weightd_warmpool_adapter_loads_total{runtime,outcome},
// weightd_warmpool_adapter_evictions_total{runtime},
// weightd_warmpool_adapter_reloads_total{runtime},
// weightd_warmpool_adapter_swap_seconds{runtime},
// weightd_warmpool_adapter_slots{state} and
// weightd_warmpool_base_gpu_memory_bytes{base} (one series per base of the
// node's warm servers).
package warmpool

import (
	"strings"

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
