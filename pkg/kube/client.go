package kube

import (
	"errors"
	"fmt"
	"os"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// ErrNoCluster says that no kubeconfig was given and the process does not
// run in a Kubernetes pod: the agent runs without Kubernetes features.
var ErrNoCluster = errors.New("no kubeconfig given and not running in a pod (KUBERNETES_SERVICE_HOST is unset)")

// Client-side rate limits of the agent's API client.
const (
	DefaultQPS   = 5
	DefaultBurst = 10
)

// RESTConfig returns the API server's client configuration: from the
// kubeconfig file when one is given, else the pod's in-cluster configuration
// when KUBERNETES_SERVICE_HOST is set, else ErrNoCluster. qps and burst are
// the client-side rate limit on every request (<= 0: DefaultQPS,
// DefaultBurst); userAgent names the client in the API server's logs.
func RESTConfig(kubeconfig string, qps float32, burst int, userAgent string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	switch {
	case kubeconfig != "":
		if cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig); err != nil {
			return nil, fmt.Errorf("loading kubeconfig %s: %w", kubeconfig, err)
		}
	case os.Getenv("KUBERNETES_SERVICE_HOST") != "":
		if cfg, err = rest.InClusterConfig(); err != nil {
			return nil, fmt.Errorf("loading the in-cluster configuration: %w", err)
		}
	default:
		return nil, ErrNoCluster
	}
	cfg.QPS, cfg.Burst = qps, burst
	if qps <= 0 {
		cfg.QPS = DefaultQPS
	}
	if burst <= 0 {
		cfg.Burst = DefaultBurst
	}
	cfg.UserAgent = userAgent
	// Protobuf for reads and watches (smaller, cheaper to decode); apply
	// patches go as YAML whatever this says.
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	return cfg, nil
}
