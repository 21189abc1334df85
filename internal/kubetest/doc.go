// Package kubetest runs a real Kubernetes API server for tests and
// benchmarks: etcd and kube-apiserver as processes, built from the Go module
// proxy (BuildAssets, `make kube-assets`) and cached by version.
//
// An Env gives an admin rest.Config, a kubeconfig file for processes and
// kubectl, and can stop and restart the API server on the same address and
// data, to test that clients ride out an API server restart. No controller
// manager, scheduler or kubelet runs: objects are stored and validated,
// admission (ValidatingAdmissionPolicy included) and RBAC apply, but
// nothing reconciles them (a DaemonSet creates no pods, a namespace being
// deleted stays Terminating). CreateNode registers a Node as a kubelet
// would.
//
// It starts the processes itself rather than through controller-runtime's
// envtest: envtest's APIServer.Stop discards its certificates and its
// admin user, so an API server it restarts has a new CA and clients made
// before cannot reconnect; and it has no way to serve the API inside a
// testbed host's network namespace (Config.Netns).
package kubetest
