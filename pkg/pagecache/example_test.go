package pagecache_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/weightd/weightd/pkg/pagecache"
)

// A warm server's base model is kept in memory while the server lives; Run
// (not shown) reads back what the kernel drops meanwhile.
func Example() {
	dir, err := os.MkdirTemp("", "pagecache-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	for name, size := range map[string]int{"model.safetensors": 3 << 20, "config.json": 512} {
		if err := os.WriteFile(filepath.Join(dir, name), make([]byte, size), 0o644); err != nil {
			log.Fatal(err)
		}
	}

	tier, err := pagecache.New(4 << 20)
	if err != nil {
		log.Fatal(err)
	}
	if err := tier.Keep(context.Background(), "default/llama-warm-0", []string{dir}); err != nil {
		log.Fatal(err)
	}
	s := tier.Status()
	fmt.Printf("kept %d files, %d of %d bytes, all resident: %v\n", len(s.Files), s.Kept, s.Budget, s.Resident == s.Kept)
	tier.Release("default/llama-warm-0")
	fmt.Printf("kept %d bytes, %d locked\n", tier.Status().Kept, tier.Status().Locked)
	// Output:
	// kept 2 files, 3146240 of 4194304 bytes, all resident: true
	// kept 0 bytes, 0 locked
}
