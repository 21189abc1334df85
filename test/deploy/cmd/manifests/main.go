// Command manifests renders deploy/ from charts/weightd (package
// test/deploy/manifests) with the Helm that `make helm` builds, and writes
// the files, or with -check only says which differ.
//
//	go run ./test/deploy/cmd/manifests          # make manifests
//	go run ./test/deploy/cmd/manifests -check
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/test/deploy/manifests"
)

func main() {
	check := flag.Bool("check", false, "write nothing: exit 1 when deploy/ differs from what the chart renders")
	root := flag.String("root", ".", "the repository's root")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *root, *check); err != nil {
		fmt.Fprintln(os.Stderr, "manifests:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, root string, check bool) error {
	helm, err := services.BuildHelm(ctx)
	if err != nil {
		return err
	}
	files, err := manifests.Render(ctx, helm, root)
	if err != nil {
		return err
	}
	if check {
		return manifests.Check(root, files)
	}
	if err := manifests.Write(root, files); err != nil {
		return err
	}
	fmt.Printf("%d files rendered from %s\n", len(files), manifests.Chart)
	return nil
}
