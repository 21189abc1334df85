package kubetest

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
)

// UserConfig returns a client configuration for user in groups, with a
// client certificate signed by the cluster's CA: a kubelet is
// system:node:<name> in system:nodes.
func (e *Env) UserConfig(user string, groups ...string) (*rest.Config, error) {
	cert, key, err := e.pki.clientCert(user, groups)
	if err != nil {
		return nil, fmt.Errorf("kubetest: a certificate for %s: %w", user, err)
	}
	cfg := rest.AnonymousClientConfig(e.Config)
	cfg.CertData, cfg.KeyData = cert, key
	return cfg, nil
}

// startControllers starts kube-controller-manager and kube-scheduler as the
// admin, as a cluster's control plane runs them (Config.ControlPlane), and
// waits until the controllers gave the default namespace its service
// account, without which the ServiceAccount admission plugin refuses pods.
func (e *Env) startControllers(ctx context.Context) error {
	kcm, err := Program(ControllerManagerBin)
	if err != nil {
		return err
	}
	sched, err := Program(SchedulerBin)
	if err != nil {
		return err
	}
	common := []string{"--kubeconfig=" + e.Kubeconfig, "--leader-elect=false", "--secure-port=0"}
	p, err := startProc(kcm, append(common,
		"--service-account-private-key-file="+e.pki.saKeyFile,
		"--root-ca-file="+e.pki.caFile,
		"--use-service-account-credentials=false",
		// Pods are given their IPs by the CNI plugin of each node, not
		// from per-node ranges.
		"--allocate-node-cidrs=false",
		// The nodes are the tests' machine: a short grace keeps a stopped
		// kubelet's node from looking ready for long.
		"--node-monitor-grace-period=20s",
	), filepath.Join(e.Dir, "kube-controller-manager.log"))
	if err != nil {
		return fmt.Errorf("kubetest: starting kube-controller-manager: %w", err)
	}
	e.mu.Lock()
	e.controllers = append(e.controllers, p)
	e.mu.Unlock()
	p, err = startProc(sched, common, filepath.Join(e.Dir, "kube-scheduler.log"))
	if err != nil {
		return fmt.Errorf("kubetest: starting kube-scheduler: %w", err)
	}
	e.mu.Lock()
	e.controllers = append(e.controllers, p)
	e.mu.Unlock()

	ctx, cancel := e.startContext(ctx)
	defer cancel()
	for {
		_, err := e.clientset.CoreV1().ServiceAccounts(metav1.NamespaceDefault).Get(ctx, "default", metav1.GetOptions{})
		if err == nil {
			return nil
		}
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("kubetest: waiting for the controllers: %w", err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kubetest: the controller manager made no default service account: %w\n%s", ctx.Err(), e.controllers[0].logTail())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// CAFile is the path of the cluster CA's certificate, which signs the API
// server's serving certificate and every client certificate.
func (e *Env) CAFile() string { return e.pki.caFile }
