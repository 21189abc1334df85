// Package policy is the node side of PrefetchPolicy (weightd.io/v1alpha1), the
// cluster-scoped custom resource that declares what a group of nodes keeps
// warm: models and container images, fetched in the background and pinned in
// the cache so that eviction never drops them.
//
//	apiVersion: weightd.io/v1alpha1
//	kind: PrefetchPolicy
//	metadata:
//	  name: llama-serving
//	spec:
//	  nodeSelector:
//	    matchLabels: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
//	  models: ["hf://meta-llama/Llama-3.1-8B-Instruct@main"]
//	  images: ["vllm/vllm-openai:v0.11.0"]
//	  pin: true            # the default
//
// There is no central controller. The Controller in every agent watches the
// policies and its own Node, evaluates each policy's selector against its
// node's labels, submits what matches to the prefetch queue at background
// priority, pins the blobs of what is ready (owner "policy/<name>") and
// unpins them when the policy goes away or stops matching. It writes only its
// own node's entry of status.nodes, with server-side apply under the field
// manager FieldManager(node): no read-modify-write, no resourceVersion, so a
// thousand agents never conflict over one object. Writes are debounced (at
// most one per policy per Config.Debounce) and skipped when the entry did not
// change. Content that cannot be had (unknown, malformed) is listed under
// failed with its reason, and a Warning Event is recorded on the policy.
//
// The counts that `kubectl get prefetchpolicies` shows (NODES, READY,
// FAILED) are kept by the agents too: when an agent sees counts that disagree
// with the entries, it corrects them after a delay that grows with its rank
// among the entries' node names, so that usually only one agent writes them
// (see Config.SummaryDelay).
//
// `kubectl get pp NAME -o yaml` answers "which nodes have model X": each
// entry lists the references ready, fetching and failed on its node.
//
// # Permissions
//
// The agent needs: get, list and watch on prefetchpolicies; patch on
// prefetchpolicies/status; get, list and watch on nodes (it watches only
// its own, by field selector); create and patch on events.
//
// # Scale
//
// Writes are cheap (one small apply per node per state change, debounced),
// but every agent watches the policies, so each write reaches every agent:
// a policy rolled out to N nodes costs about 2·N writes and 2·N² watch
// deliveries of an object that grows with N (an entry is a few hundred
// bytes, and the managed fields add about as much again; the informer drops
// them after decoding). That is fine for hundreds of nodes per policy; for
// thousands, split the fleet over several policies (bench/policystatus
// measures it; docs/policy-status-scale.md has the figures and the
// options for growing linearly). Entries of nodes
// deleted from the cluster stay until someone removes them (RemoveEntry).
//
// CRD holds the CustomResourceDefinition (the same bytes as
// deploy/daemonset/crd.yaml).
package policy
