// Package warmpool keeps LoRA adapters hot-swapped into warm inference
// servers: servers on this node that keep a base model resident in GPU
// memory. It chooses a server for each adapter, fetches and stages the
// adapter, loads it through the runtime's API (package engine), evicts the
// least recently used adapter when a server's slots are full, and rebuilds
// its state from the servers after a restart of the agent or of a server.
package warmpool

import "github.com/weightd/weightd/pkg/warmpool/engine"

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
	// --max-loras, SGLang --max-loras-per-batch).
	Slots int
	// MaxRank is the largest LoRA rank the server takes (vLLM
	// --max-lora-rank); 0 when unknown.
	MaxRank int
}
