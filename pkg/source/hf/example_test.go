package hf_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source/hf"
)

// An hf:// reference resolves to the repository's files at a commit, then
// each blob is fetched into the store and the model is materialised in the
// hub cache layout.
func ExampleSource() {
	hub := hubtest.New() // an in-process hub; in production, the endpoint is HF_ENDPOINT
	defer hub.Close()
	hub.AddRepo("org/tiny", map[string]hubtest.Content{
		"config.json":       hubtest.String(`{"model_type": "llama"}`),
		"model.safetensors": hubtest.Generated(1<<20, 1),
	})

	// A private or gated repository needs WithToken(token) too.
	src, err := hf.New(nil, hf.WithEndpoint(hub.URL))
	if err != nil {
		log.Fatal(err)
	}
	r, err := ref.Parse("hf://org/tiny@main")
	if err != nil {
		log.Fatal(err)
	}
	res, err := src.Resolve(context.Background(), r)
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range res.Model.Files {
		fmt.Println(f.Path, f.Size)
	}

	dir, err := os.MkdirTemp("", "weightd-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	store, err := cache.Open(dir)
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	for _, f := range res.Model.Files {
		if _, err := store.Fetch(context.Background(), f.Descriptor, res.Blobs[f.Digest], nil); err != nil {
			log.Fatal(err)
		}
	}
	snapshot, err := store.Materialize(res.Model)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(snapshot == dir+"/models/models--org--tiny/snapshots/"+res.Model.Revision)
	// Output:
	// config.json 23
	// model.safetensors 1048576
	// true
}
