package services

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// PromtoolVersion is the Go module version of the Prometheus release
// (v0.316.0 is Prometheus 3.16.0) whose promtool checks and unit-tests the
// chart's alert rules (test/monitoring), built by BuildPromtool. Keep it at
// the github.com/prometheus/prometheus that go.mod requires, so promtool
// and the PromQL engine of the other monitoring tests agree.
const PromtoolVersion = "v0.316.0"

// ErrPromtoolNotBuilt is returned (wrapped) by CachedPromtool when promtool
// has not been built yet.
var ErrPromtoolNotBuilt = errors.New("promtool not built")

// PromtoolCacheDir returns the directory BuildPromtool builds
// PromtoolVersion into and reuses: $WEIGHTD_PROMTOOL_CACHE/promtool-<version>
// when that variable is set, else $HOME/.cache/weightd/promtool-<version>.
func PromtoolCacheDir() (string, error) {
	return toolCacheDir("WEIGHTD_PROMTOOL_CACHE", "promtool-"+strings.TrimPrefix(PromtoolVersion, "v"))
}

func promtoolInstall() (goInstall, error) {
	dir, err := PromtoolCacheDir()
	if err != nil {
		return goInstall{}, err
	}
	return goInstall{
		What: "promtool " + PromtoolVersion,
		Dir:  dir,
		Pkgs: []string{"github.com/prometheus/prometheus/cmd/promtool@" + PromtoolVersion},
		// Prometheus's release builds stamp the version; `go install`
		// leaves it empty. This one says which module version it is.
		LDFlags: "-s -w -X github.com/prometheus/common/version.Version=" + strings.TrimPrefix(PromtoolVersion, "v"),
		Bins:    []string{"promtool"},
	}, nil
}

// CachedPromtool returns the path of promtool PromtoolVersion in
// PromtoolCacheDir without building it: an error wrapping
// ErrPromtoolNotBuilt when it is not there.
func CachedPromtool() (string, error) {
	return cachedTool(promtoolInstall, ErrPromtoolNotBuilt, "promtool")
}

// BuildPromtool returns the path of promtool PromtoolVersion, building it
// from the Go module proxy into PromtoolCacheDir unless it is there
// already: about 7 minutes on 2 cores with a cold Go build cache, nothing
// once built. It is built and installed as BuildContainerd builds containerd.
func BuildPromtool(ctx context.Context) (string, error) { return buildTool(ctx, promtoolInstall) }

// RequirePromtool returns the path of the promtool that `make promtool`
// builds (CachedPromtool). Where it is not built the test skips, except
// under CI=true, where it fails: `make test` builds it.
func RequirePromtool(tb testing.TB) string {
	tb.Helper()
	return requireTool(tb, CachedPromtool, ErrPromtoolNotBuilt)
}
