package hubtest_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"path/filepath"

	"github.com/weightd/weightd/internal/hubtest"
)

// A hub with one repository: a git file served directly, an LFS file
// redirected to the CDN, and a file read from disk.
func Example() {
	hub := hubtest.New()
	defer hub.Close()

	dir, err := os.MkdirTemp("", "hubtest-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "weights.bin")
	if err := os.WriteFile(path, []byte("weights"), 0o644); err != nil {
		log.Fatal(err)
	}
	onDisk, err := hubtest.FromFile(path)
	if err != nil {
		log.Fatal(err)
	}
	hub.AddRepo("org/model", map[string]hubtest.Content{
		"config.json":       hubtest.String("{}"),
		"model.safetensors": hubtest.Generated(64<<20, 1), // generated as served, never held in memory
		"extra/weights.bin": onDisk,
	})

	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for _, p := range []string{"config.json", "model.safetensors", "extra/weights.bin"} {
		resp, err := client.Head(hub.URL + "/org/model/resolve/main/" + p)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		fmt.Printf("%s %d X-Linked-Size=%q\n", p, resp.StatusCode, resp.Header.Get("X-Linked-Size"))
	}
	resp, err := http.Get(hub.URL + "/org/model/resolve/main/extra/weights.bin")
	if err != nil {
		log.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Printf("%s %d bytes served\n", body, hub.Stats().Bytes)
	// Output:
	// config.json 200 X-Linked-Size=""
	// model.safetensors 302 X-Linked-Size="67108864"
	// extra/weights.bin 302 X-Linked-Size="7"
	// weights 7 bytes served
}
