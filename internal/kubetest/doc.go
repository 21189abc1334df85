// Package kubetest runs a real Kubernetes API server (etcd and
// kube-apiserver) for tests and benchmarks.
package kubetest

import (
	_ "k8s.io/api/core/v1"
	_ "k8s.io/apimachinery/pkg/apis/meta/v1"
	_ "k8s.io/client-go/kubernetes"
	_ "k8s.io/client-go/rest"
	_ "k8s.io/kube-scheduler/framework"
	_ "sigs.k8s.io/controller-runtime/pkg/envtest"
)
