// Package extender is weightd's kube-scheduler extender: an http.Handler
// that answers the scheduler's prioritize and filter calls from the cache
// state weightd agents publish on their Node objects (package nodestate), so
// pods land on nodes that already hold the models and images they ask for
// (package podrequest).
//
// Prioritize scores each candidate node 0 to 10 by the fraction of the pod's
// requested bytes the node holds. Each reference weighs its size: a model's
// total as any node's summary reports it (cluster-wide knowledge, so a node
// that has not started a model still knows what it lacks), an image's size
// as the kubelet reports it in status.images; a reference whose size no node
// knows weighs as much as the average known one (all weigh the same when no
// size is known). A node holds a reference fully when its ready label, its
// summary or its status.images says so, else the bytes its summary reports.
// The fraction maps to 0 for nothing, 10 for everything and the nearest of 1
// to 9 in between.
//
// Filter removes nodes that do not hold
// everything a pod with the weightd.io/require-warm annotation asks for, and
// passes every node for other pods. A pod without weightd annotations is
// answered at once; a pod whose annotations do not parse is never refused: it
// scores 0 everywhere and passes every filter, and the reason is logged.
//
// Both modes of the extender protocol are served: the scheduler sends full
// Node objects (nodeCacheCapable: false), or only node names
// (nodeCacheCapable: true) and the extender reads node state from its own
// Cache, kept current by a Watcher (a node informer). Per-node state is
// computed when a node changes, not per request.
//
//	c := extender.NewCache()
//	w := extender.NewWatcher(client, c)          // go w.Run(ctx)
//	h, _ := extender.NewHandler(c, extender.WithRegisterer(reg))
//	mux.Handle("/", h)                            // POST /prioritize, POST /filter
package extender
