// Command helm builds the Helm that the chart's tests run
// (services.HelmVersion) from the Go module proxy into
// services.HelmCacheDir, and prints its path. A helm already there is
// kept; the first build takes about five minutes on two cores.
//
//	go run ./internal/services/cmd/helm
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/weightd/weightd/internal/services"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	p, err := services.BuildHelm(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helm:", err)
		os.Exit(1)
	}
	fmt.Println(p)
}
