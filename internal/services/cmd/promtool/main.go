// Command promtool builds the promtool that the alert rules' tests run
// (services.PromtoolVersion) from the Go module proxy into
// services.PromtoolCacheDir, and prints its path. A promtool already there
// is kept; the first build takes about 7 minutes on two idle cores.
//
//	go run ./internal/services/cmd/promtool
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
	p, err := services.BuildPromtool(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "promtool:", err)
		os.Exit(1)
	}
	fmt.Println(p)
}
