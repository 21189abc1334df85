package loratest_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// A vLLM test server with two adapter slots, an adapter written to disk,
// and the vLLM driver loading it.
func Example() {
	srv, err := loratest.NewVLLM(loratest.Options{Base: "org/base", Slots: 2})
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Close()

	dir, err := os.MkdirTemp("", "loratest-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "sql")
	if err := loratest.WriteAdapter(path, loratest.AdapterSpec{Rank: 16, Base: "org/base"}); err != nil {
		log.Fatal(err)
	}

	d, err := engine.NewVLLM(srv.URL(), nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := d.Load(context.Background(), "sql", path, false); err != nil {
		log.Fatal(err)
	}
	adapters, err := d.Adapters(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(adapters[0].Name, adapters[0].Parent, srv.Loads("sql"))
	// Output: sql org/base 1
}
