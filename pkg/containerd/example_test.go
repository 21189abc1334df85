package containerd_test

import (
	"context"
	"log"

	"github.com/weightd/weightd/pkg/cache"
	ctrimport "github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/source"
)

// An image whose blobs the cache holds (resolved and fetched by prefetch)
// is imported into the node's containerd, where the kubelet finds it.
func ExampleImporter_Import() {
	store, err := cache.Open("/var/lib/weightd/cache")
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	im, err := ctrimport.New(ctrimport.DefaultConfig(), store)
	if err != nil {
		log.Fatal(err)
	}
	defer im.Close()

	var img *source.Image // from a source.Resolution, its blobs fetched into store
	if err := im.Import(context.Background(), img); err != nil {
		log.Fatal(err)
	}
}
