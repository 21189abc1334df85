package api_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

// An agent's API on a unix socket, and a client that fetches a model through
// it and follows the job to its end.
func Example() {
	dir, err := os.MkdirTemp("", "weightd-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	// An origin serving a generated two-file model.
	if _, err := genmodel.Generate(filepath.Join(dir, "origin"), genmodel.Spec{Name: "org/model", Files: 2, TotalBytes: 1 << 20}); err != nil {
		log.Fatal(err)
	}
	org := httptest.NewServer(genmodel.NewServer(nil, filepath.Join(dir, "origin")))
	defer org.Close()

	// The agent side: cache, queue, API server.
	store, err := cache.Open(filepath.Join(dir, "cache"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	queue := prefetch.NewQueue(store, httpsource.New(nil))
	srv, err := api.NewServer(api.QueueJobs(queue), store)
	if err != nil {
		log.Fatal(err)
	}
	addr := "unix://" + filepath.Join(dir, "weightd.sock")
	ln, err := api.Listen(addr)
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = queue.Run(ctx) }() // Run returns when ctx ends
	hs := &http.Server{Handler: srv}
	go func() { _ = hs.Serve(ln) }() // ErrServerClosed after Close
	defer hs.Close()

	// The client side: what `weightd fetch REF --wait` does.
	client, err := api.NewClient(addr)
	if err != nil {
		log.Fatal(err)
	}
	job, err := client.Fetch(ctx, org.URL+"/model.json")
	if err != nil {
		log.Fatal(err)
	}
	final, err := client.Watch(ctx, job.ID, nil) // or a func showing progress
	if err != nil {
		log.Fatal(err)
	}
	// final.Model names the model after its URL (host, path and a key of
	// them), never as its manifest names itself.
	fmt.Println(final.State, final.FilesDone, "files,", final.BytesDone, "bytes")
	// Output: ready 2 files, 1048576 bytes
}
