// Package e2e runs weightd the way its users run it, on a real node: a
// control plane (etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler) and a kubelet on containerd's CRI with runc and the CNI
// bridge (internal/kubetest, internal/kubenode), weightd's image built as
// `make image` builds it and imported into the node's containerd, and the
// Helm chart installed with the helm binary, as root on this machine. Its
// tests check what a user sees: pods' images pulled by the kubelet through
// the agent's mirror, a pod reading its model by name from the node's Hugging
// Face cache, status annotations, node labels and PrefetchPolicy status,
// and downloads that survive a rolling update and a killed agent.
//
// One node runs, in the machine's own network namespace: a second kubelet
// in a network namespace would need the API server and the agents' host
// ports routed into it, which this harness does not do yet. A second agent
// runs as a plain process, with no kubelet, in a network namespace joined
// to the node's by a shaped link (internal/testbed): the node's peer, from
// which a pod's CSI volume is filled. GPUs are not covered (no GPU here),
// nor any managed cluster.
package e2e
