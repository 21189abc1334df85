// Command containerd2 builds the containerd 2.x daemon and ctr that the
// tests and bench/mirrorswarm run (services.Containerd2Version), from the Go
// module proxy, into services.ContainerdCacheDir, and prints their
// directory. Binaries already there are kept; the first build takes about
// three minutes on two cores.
//
//	go run ./internal/services/cmd/containerd2
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/weightd/weightd/internal/services"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	bins, err := services.BuildContainerd(ctx, services.Containerd2Version)
	if err != nil {
		fmt.Fprintln(os.Stderr, "containerd2:", err)
		os.Exit(1)
	}
	fmt.Println(filepath.Dir(bins.Containerd))
}
