package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// TestDocIsFresh regenerates docs/metrics.md in memory from the source and
// fails when the committed page differs (or a metric breaks the rules).
func TestDocIsFresh(t *testing.T) {
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	page, err := generate(root)
	if err != nil {
		t.Fatal(err)
	}
	doc := filepath.Join(root, "docs", "metrics.md")
	have, err := os.ReadFile(doc)
	if err != nil {
		t.Fatalf("%v: run %s", err, command)
	}
	if !bytes.Equal(have, page) {
		t.Fatalf("%s is stale: run %s", doc, command)
	}
}
