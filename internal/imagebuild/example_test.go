package imagebuild_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/weightd/weightd/internal/imagebuild"
)

// An end-to-end test's set-up: weightd built from the checkout, its image
// written for `ctr images import` and pushed to a test registry.
func Example() {
	ctx := context.Background()
	bin, err := imagebuild.Compile(ctx, imagebuild.CompileOptions{
		ModuleDir: ".",
		Out:       "bin/e2e/weightd",
		Version:   "v0.0.0-e2e",
		Commit:    "abc1234",
	})
	if err != nil {
		log.Fatal(err)
	}
	idx, err := imagebuild.Build(ctx, imagebuild.Options{
		Binaries: []imagebuild.Binary{bin},
		Version:  "v0.0.0-e2e",
		Revision: "abc1234",
		Created:  time.Unix(1767225600, 0),
	})
	if err != nil {
		log.Fatal(err)
	}
	const ref = "127.0.0.1:5000/weightd:e2e"
	if err := imagebuild.WriteTarball("bin/e2e/weightd-image.tar", ref, idx); err != nil {
		log.Fatal(err)
	}
	if err := imagebuild.Push(ctx, ref, idx, false); err != nil {
		log.Fatal(err)
	}
	fmt.Println(ref)
}
