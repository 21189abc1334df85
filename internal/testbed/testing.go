package testbed

import (
	"os"
	"testing"
)

// Require skips the test when this machine cannot host a testbed (see
// Available), except under CI=true, where a missing testbed is a broken CI
// machine and the test fails.
func Require(tb testing.TB) {
	tb.Helper()
	if err := Available(); err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("CI=true but %v", err)
		}
		tb.Skipf("skipping: %v", err)
	}
}

// NewT is New for tests: it calls Require, fails the test if the testbed
// cannot be created, and closes the testbed when the test ends.
func NewT(tb testing.TB, cfg Config) *Testbed {
	tb.Helper()
	Require(tb)
	t, err := New(tb.Context(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := t.Close(); err != nil {
			tb.Errorf("%v", err)
		}
	})
	return t
}
