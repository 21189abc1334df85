package services

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// RegistryAvailable says why a registry cannot be started here, or nil.
func RegistryAvailable() error {
	if _, err := exec.LookPath(RegistryBinary); err != nil {
		return fmt.Errorf("%s not installed (apt-get install docker-registry, or make test-deps)", RegistryBinary)
	}
	return nil
}

// ContainerdAvailable says why containerd cannot be started here, or nil: it
// needs its binaries and root (overlayfs mounts).
func ContainerdAvailable() error {
	var errs []error
	for _, b := range []string{ContainerdBinary, CtrBinary} {
		if _, err := exec.LookPath(b); err != nil {
			errs = append(errs, fmt.Errorf("%s not installed (apt-get install containerd, or make test-deps)", b))
		}
	}
	if os.Geteuid() != 0 {
		errs = append(errs, errors.New("containerd needs root"))
	}
	return errors.Join(errs...)
}

// RequireRegistry skips the test when a registry cannot be started here,
// except under CI=true, where it fails the test.
func RequireRegistry(tb testing.TB) {
	tb.Helper()
	require(tb, RegistryAvailable())
}

// RequireContainerd skips the test when containerd cannot be started here,
// except under CI=true, where it fails the test.
func RequireContainerd(tb testing.TB) {
	tb.Helper()
	require(tb, ContainerdAvailable())
}

// RequireContainerd2 returns the containerd 2.x that `make test-deps`
// builds (Containerd2Version); without it the test skips, except under
// CI=true, where it fails.
func RequireContainerd2(tb testing.TB) ContainerdBinaries {
	tb.Helper()
	bins, err := CachedContainerd(Containerd2Version)
	if err != nil && !errors.Is(err, ErrContainerdNotBuilt) {
		tb.Fatal(err)
	}
	require(tb, err)
	return bins
}

func require(tb testing.TB, err error) {
	tb.Helper()
	if err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		tb.Fatalf("CI=true but %v", err)
	}
	tb.Skipf("skipping: %v", err)
}

// NewRegistryT is StartRegistry for tests: it calls RequireRegistry, puts the
// registry in a temporary directory when cfg.Dir is empty, fails the test if
// the registry does not start, and closes it when the test ends.
func NewRegistryT(tb testing.TB, cfg RegistryConfig) *Registry {
	tb.Helper()
	RequireRegistry(tb)
	if cfg.Dir == "" {
		cfg.Dir = tb.TempDir()
	}
	r, err := StartRegistry(tb.Context(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("docker-registry's log ends:\n%s", r.LogTail())
		}
		if err := r.Close(); err != nil {
			tb.Errorf("closing the registry: %v", err)
		}
	})
	return r
}

// NewContainerdT is StartContainerd for tests: it skips the test (or fails
// it under CI=true) when cfg.Binaries cannot run here, puts the daemon in a temporary directory when cfg.Dir is empty, fails the
// test if it does not start, and closes it when the test ends (logging the
// end of its log if the test failed).
func NewContainerdT(tb testing.TB, cfg ContainerdConfig) *Containerd {
	tb.Helper()
	require(tb, cfg.Binaries.available())
	if cfg.Dir == "" {
		cfg.Dir = tb.TempDir()
	}
	c, err := StartContainerd(tb.Context(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if tb.Failed() {
			tb.Logf("containerd's log ends:\n%s", c.LogTail())
		}
		if err := c.Close(); err != nil {
			tb.Errorf("closing containerd: %v", err)
		}
	})
	return c
}

// requireTool returns cached's program for a test. Where it is not built
// (notBuilt) the test skips, except under CI=true, where it fails: `make
// test` builds it.
func requireTool(tb testing.TB, cached func() (string, error), notBuilt error) string {
	tb.Helper()
	p, err := cached()
	if errors.Is(err, notBuilt) {
		require(tb, err)
	} else if err != nil {
		tb.Fatal(err)
	}
	return p
}
