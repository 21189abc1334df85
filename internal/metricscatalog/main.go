// Command metricscatalog writes docs/metrics.md, the catalogue of every
// weightd metric, from the repository's Go source (see package catalog):
//
//	go run ./internal/metricscatalog -w docs/metrics.md
//
// Without -w it prints the page. It fails, writing nothing, when a metric
// cannot be read from the source or breaks the naming rules.
package main

import (
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"

	"github.com/weightd/weightd/internal/metricscatalog/catalog"
)

// command is how the page says it is regenerated.
const command = "go run ./internal/metricscatalog -w docs/metrics.md"

func main() {
	write := flag.String("w", "", "write the page to this file instead of standard output")
	root := flag.String("root", "", "module root to scan (default: the module holding the working directory)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("metricscatalog: ")
	page, err := generate(*root)
	if err != nil {
		log.Fatal(err)
	}
	if *write == "" {
		_, err = os.Stdout.Write(page)
	} else {
		err = os.WriteFile(*write, page, 0o644)
	}
	if err != nil {
		log.Fatal(err)
	}
}

// generate scans the module at root (found from the working directory when
// empty), lints the catalogue and renders the page.
func generate(root string) ([]byte, error) {
	if root == "" {
		var err error
		if root, err = moduleRoot(); err != nil {
			return nil, err
		}
	}
	cat, err := catalog.Scan(root)
	if err != nil {
		return nil, fmt.Errorf("scanning %s: %w", root, err)
	}
	if problems := cat.Lint(); len(problems) > 0 {
		return nil, fmt.Errorf("metrics break the naming rules:\n%s", strings.Join(problems, "\n"))
	}
	return cat.Markdown(command), nil
}

// moduleRoot is the nearest directory at or above the working directory
// that holds a go.mod.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod at or above the working directory")
		}
		dir = parent
	}
}
