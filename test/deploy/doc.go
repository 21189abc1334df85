// Package deploy tests deploy/daemonset, the kustomize deployment of the
// agent, against a real API server (internal/kubetest): kubectl applies it,
// the objects exist, and the admission policy lets an agent change only its
// own node and the pods bound to it.
package deploy
