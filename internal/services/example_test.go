package services_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/weightd/weightd/internal/services"
)

// A benchmark's set-up: a registry holding a 2 GiB image and a containerd
// to pull it into, each in its own directory.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "bench")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	reg, err := services.StartRegistry(ctx, services.RegistryConfig{Dir: dir + "/registry"})
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Close()
	ctd, err := services.StartContainerd(ctx, services.ContainerdConfig{Dir: dir + "/containerd"})
	if err != nil {
		log.Fatal(err)
	}
	defer ctd.Close()

	img, err := services.PushRandomImage(ctx, reg.Addr, "bench/image", "v1", 8, 256<<20, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := ctd.Ctr(ctx, "images", "pull", "--plain-http", img.Ref); err != nil {
		log.Fatal(err)
	}
	fmt.Println(img.Size, reg.BytesServed())
}
