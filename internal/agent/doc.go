// Package agent builds the weightd node agent's component graph from a
// Config and runs it. `weightd agent` fills the Config from flags, the
// environment and its YAML file; the demo and tests fill it in code, so
// every in-process agent is wired the same way.
//
// New builds the graph, in data-path order:
//
//   - sources: the origins references resolve on (HTTP, OCI registries,
//     the hub, S3), behind one dial guard;
//   - swarm: with gossip on, membership, the chunk server and the swarm,
//     which every resolved blob goes through (p2p.NewSwarmSource), and
//     which resolves from peers while an origin is down;
//   - cache and queue: the verified store and the prefetch queue that
//     fills it, ordering files by the load tracer's record;
//   - consumers of the cache: the registry mirror and containerd import
//     (images), the warm pool and its DRAM tier (bases and adapters), the
//     CSI plugin (models as volumes), and, with a cluster, the Kubernetes
//     side: pod intake, node publisher, policy, warm-server discovery,
//     Node events and pod volumes, sharing one watch of the node's pods,
//     one of its Node and one event broadcaster (kube.Shared);
//   - pods: served through the local API, the mirror, CSI volumes and the
//     warm servers; GPUs, metrics and profiles are read beside them.
//
// New opens listeners but starts no component; Run runs every component under
// one errgroup until its context ends or one fails, then closes the cache.
package agent
