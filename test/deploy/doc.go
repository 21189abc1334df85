// Package deploy tests charts/weightd, the Helm chart, and deploy/daemonset,
// the kustomize deployment of the agent that is rendered from it
// (test/deploy/manifests, `make manifests`). The chart lints clean, renders
// with its defaults and with every feature on, refuses values that make no
// sense with a message that names them, installs and upgrades on a real API
// server (internal/kubetest) keeping its gossip key, and deploy/ is what it
// renders. Both mount containerd's root at its host path with the cache
// inside it, so that image blobs are hard-linked into containerd's content
// store. kubectl applies deploy/daemonset, the objects exist, and the
// admission policy lets an agent change only its own node and the pods
// bound to it.
package deploy
