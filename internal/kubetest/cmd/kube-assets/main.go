// Command kube-assets builds the kube-apiserver and etcd binaries that
// internal/kubetest runs, from the Go module proxy, into the directory
// keyed by version (kubetest.AssetsDir: $WEIGHTD_KUBE_ASSETS or
// $HOME/.cache/weightd/kube-1.37.2), and prints that directory. Binaries
// already there are kept. The first build takes about ten minutes on two
// cores.
//
//	go run ./internal/kubetest/cmd/kube-assets
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/weightd/weightd/internal/kubetest"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "kube-assets:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	if d := os.Getenv("KUBEBUILDER_ASSETS"); d != "" {
		if found, err := kubetest.FindAssets(); err == nil && found == d {
			fmt.Println(d)
			return nil
		}
	}
	dir, err := kubetest.AssetsDir()
	if err != nil {
		return err
	}
	if _, err := kubetest.FindAssets(); err != nil {
		fmt.Fprintf(os.Stderr, "building kube-apiserver %s and etcd %s into %s (about ten minutes the first time)\n",
			kubetest.KubernetesVersion, kubetest.EtcdVersion, dir)
	}
	start := time.Now()
	if err := kubetest.BuildAssets(ctx, dir, os.Stderr); err != nil {
		return err
	}
	if d := time.Since(start); d > time.Second {
		fmt.Fprintf(os.Stderr, "built in %s\n", d.Round(time.Second))
	}
	fmt.Println(dir)
	return nil
}
