package services

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// HelmVersion is the Helm release the chart's tests run (charts/weightd),
// built by BuildHelm.
const HelmVersion = "v4.3.2"

// ErrHelmNotBuilt is returned (wrapped) by CachedHelm when Helm has not
// been built yet.
var ErrHelmNotBuilt = errors.New("helm not built")

// HelmCacheDir returns the directory BuildHelm builds HelmVersion into and
// reuses: $WEIGHTD_HELM_CACHE/helm-<version> when that variable is set,
// else $HOME/.cache/weightd/helm-<version>.
func HelmCacheDir() (string, error) {
	return toolCacheDir("WEIGHTD_HELM_CACHE", "helm-"+strings.TrimPrefix(HelmVersion, "v"))
}

func helmInstall() (goInstall, error) {
	dir, err := HelmCacheDir()
	if err != nil {
		return goInstall{}, err
	}
	return goInstall{
		What: "helm " + HelmVersion,
		Dir:  dir,
		Pkgs: []string{"helm.sh/helm/v4/cmd/helm@" + HelmVersion},
		// Helm's own release builds stamp the full version; `go install`
		// leaves only "v4.3".
		LDFlags: "-s -w -X helm.sh/helm/v4/internal/version.version=" + HelmVersion,
		Bins:    []string{"helm"},
	}, nil
}

// CachedHelm returns the path of helm HelmVersion in HelmCacheDir without
// building it: an error wrapping ErrHelmNotBuilt when it is not there.
func CachedHelm() (string, error) {
	return cachedTool(helmInstall, ErrHelmNotBuilt, "helm")
}

// BuildHelm returns the path of helm HelmVersion, building it from the Go
// module proxy into HelmCacheDir unless it is there already: about 5
// minutes on 2 cores with a cold Go build cache, nothing once built. It is
// built and installed as BuildContainerd builds containerd.
func BuildHelm(ctx context.Context) (string, error) { return buildTool(ctx, helmInstall) }

// RequireHelm returns the path of the helm that `make helm` builds
// (CachedHelm). Where it is not built the test skips, except under
// CI=true, where it fails: `make test` builds it.
func RequireHelm(tb testing.TB) string {
	tb.Helper()
	return requireTool(tb, CachedHelm, ErrHelmNotBuilt)
}
