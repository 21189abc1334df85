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
// unpins them when the policy goes away or stops matching. It reports its
// node's progress in a PrefetchPolicyNode of its own, NodeObjectName(policy,
// node) ("<policy>.<node>"), labelled PolicyLabel and NodeLabel, owned by
// the policy (so the garbage collector deletes it with the policy), with
// server-side apply under the field manager FieldManager(node). It watches
// none of them: what it applied last is what is there. Writes are debounced
// (at most one per policy per Config.Debounce) and skipped when the status
// did not change; when the node stops matching, the object is deleted.
// Content that cannot be had (unknown, malformed) is listed under failed
// with its reason, and a Warning Event is recorded on the policy.
//
// The counts that `kubectl get prefetchpolicies` shows (NODES, READY,
// FAILED) are written by the Summarizer that every agent runs: the one
// that holds a coordination.k8s.io Lease watches the PrefetchPolicyNodes
// (their only watcher) and applies a policy's counts when they changed, at
// most once per SummaryConfig.Interval, so they are up to one interval
// late.
//
// `kubectl get prefetchpolicynodes -l weightd.io/policy=NAME` (short name
// ppn) answers "which nodes have model X": NODE, STATE and the numbers of
// references READY and FAILED, the lists in -o yaml; with
// `--field-selector status.state=Failed` (the CRD's selectableFields) only
// the failed nodes.
//
// # Permissions
//
// The agent needs: get, list and watch on prefetchpolicies; patch on
// prefetchpolicies/status (the counts); get, list, watch, create, patch
// and delete on prefetchpolicynodes (the deploy's admission policy lets it
// write only its own node's); get, list and watch on nodes (it watches
// only its own, by field selector); create and patch on events; and in
// the Lease's namespace create on leases and get and update on the Lease.
//
// # Scale
//
// A policy rolled out to N nodes costs N to 2·N small applies, one object
// each (no contention), each delivered to one watcher (the leader), plus
// one count write per interval while the counts move, each delivered to the
// N agents that watch the policies: linear in N, and the object the agents
// watch no longer grows with N (docs/policy-status-scale.md has the
// figures, bench/policystatus measures it). A candidate for the Lease that
// does not lead reads it every SummaryConfig.RetryPeriod (15s by default)
// or so; the agent makes only three agents candidates when gossip tells
// them apart (SummaryConfig.Candidate), else all, about N/25 requests a
// second. PrefetchPolicyNodes of
// nodes deleted from the cluster stay until the policy is deleted or
// someone deletes them (DeleteNodeStatus), but are not counted: the leader
// also watches the Nodes' metadata.
//
// CRD holds the CustomResourceDefinitions (the same bytes as
// deploy/daemonset/crd.yaml).
package policy
