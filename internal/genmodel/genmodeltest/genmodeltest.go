// Package genmodeltest serves generated models (package genmodel) to tests:
// one call in place of generating, listening, running and cleaning up.
package genmodeltest

import (
	"context"
	"net"
	"testing"

	"github.com/weightd/weightd/internal/genmodel"
)

// Origin is a generated model served over HTTP on loopback for one test.
type Origin struct {
	*genmodel.Server
	Manifest *genmodel.Manifest
	Dir      string // where the model's files are
}

// Ref is the reference to the model's manifest, which names every file.
func (o *Origin) Ref() string { return o.URL() + "/" + genmodel.ManifestName }

// Start generates spec into a temporary directory and serves it until the
// test ends.
func Start(t testing.TB, spec genmodel.Spec, opts ...genmodel.ServerOption) *Origin {
	t.Helper()
	dir := t.TempDir()
	m, err := genmodel.Generate(dir, spec)
	if err != nil {
		t.Fatalf("generating %s: %v", spec.Name, err)
	}
	return &Origin{Server: Serve(t, dir, opts...), Manifest: m, Dir: dir}
}

// Serve serves the files under dir until the test ends, and fails the test
// if the server ends with an error.
func Serve(t testing.TB, dir string, opts ...genmodel.ServerOption) *genmodel.Server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("origin: %v", err)
	}
	srv := genmodel.NewServer(ln, dir, opts...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("origin: %v", err)
		}
	})
	return srv
}
