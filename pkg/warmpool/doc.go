// Package warmpool keeps LoRA adapters hot-swapped into warm inference
// servers: servers on this node that keep a base model resident in GPU
// memory. It chooses a server for each adapter, fetches and stages the
// adapter, loads it through the runtime's API (package engine), evicts an
// adapter when the slots of a base's servers are full, and rebuilds its
// state from the servers after a restart of the agent or of a server.
//
// A Pool is fed its servers by discovery (SetServers) and answers
// Ensure(base, adapter) from the local API (it implements api.Adapters) and
// EnsureFor on behalf of a pod, whose use keeps the adapter loaded until
// Release. An ensure finds the adapter loaded on a server of the base, else
// fetches it (Fetcher: the cache and swarm), checks its files (lora.Inspect:
// config, safetensors header, rank against the server's maximum) before any
// runtime sees it, reserves a slot (a free one, else an adapter neither
// pinned, in use nor loading is unloaded), stages it under StageDir
// (hard links into the cache, renamed into place whole), loads it and checks
// that the server lists it. Concurrent ensures of one adapter share one
// load. Run checks the servers' health and listings, adopts what they hold
// after a restart of the agent and loads again, after a restart of a server,
// the adapters still pinned or in use.
//
// Eviction (Config.Eviction) is by default frequency-aware: the victim is
// the evictable adapter of the fewest recent uses, the least recently used
// of those. A few slots face many adapters, so the counts cover adapters not
// loaded too (an evicted one keeps its count, and a popular adapter evicted
// once wins its slot back at its next use, while a newcomer used once is the
// next to go) and age: each base's counts are halved every 10 uses per slot
// of its servers (TinyLFU's reset), so an adapter popular long ago loses to
// one popular now. Slots are per server, but any server of the base may take
// any adapter, so the victim is chosen among all of them. "lru" keeps the
// older policy; bench/adapterhit measures both against Belady's.
//
// Its metrics (weightd_warmpool_*) are listed in docs/metrics.md.
package warmpool
