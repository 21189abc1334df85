package kubetest

import (
	"os"
	"testing"
)

// Require skips the test when the kube-apiserver and etcd binaries are not
// built (see FindAssets), except under CI=true, where missing binaries are
// a broken CI machine (`make test` builds them) and the test fails.
func Require(tb testing.TB) {
	tb.Helper()
	if _, err := FindAssets(); err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("CI=true but %v", err)
		}
		tb.Skipf("skipping: %v", err)
	}
}

// NewT is Start for tests: it calls Require, fails the test if the
// environment does not start, and closes it when the test ends.
func NewT(tb testing.TB, cfg Config) *Env {
	tb.Helper()
	Require(tb)
	e, err := Start(tb.Context(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := e.Close(); err != nil {
			tb.Errorf("stopping the API server: %v", err)
		}
	})
	return e
}
