package containerd_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	ctrimport "github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/mirror"
)

// daemons are the containerd releases the registry config is read from:
// Debian's 1.6 and the 2.x that `make test-deps` builds.
var daemons = []struct {
	name string
	v2   bool
}{{"1.6", false}, {"2.x", true}}

// binaries returns the daemon's binaries: zero for Debian's 1.6. Without a
// built 2.x the test skips, and fails under CI=true.
func binaries(t *testing.T, v2 bool) services.ContainerdBinaries {
	t.Helper()
	services.RequireContainerd(t)
	if !v2 {
		return services.ContainerdBinaries{}
	}
	bins, err := services.CachedContainerd(services.Containerd2Version)
	if errors.Is(err, services.ErrContainerdNotBuilt) {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but %v: make test-deps builds it", err)
		}
		t.Skip(err)
	}
	require.NoError(t, err)
	return bins
}

// TestReadRegistryConfig asks real daemons, with config_path set and
// unset, what their CRI registry config_path is: 1.6 says it in its CRI
// Status, 2.4 in its image plugin's exports, with its default when unset.
func TestReadRegistryConfig(t *testing.T) {
	t.Parallel()
	for _, d := range daemons {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bins := binaries(t, d.v2)
			for _, unset := range []bool{false, true} {
				name := map[bool]string{false: "set", true: "unset"}[unset]
				t.Run(name, func(t *testing.T) {
					ctd := services.NewContainerdT(t, services.ContainerdConfig{Binaries: bins, NoConfigPath: unset})
					rc, err := ctrimport.ReadRegistryConfig(t.Context(), ctd.Address)
					require.NoError(t, err, "containerd's log ends:\n%s", ctd.LogTail())
					t.Logf("%+v", rc)
					want := ctrimport.RegistryConfig{Version: rc.Version, ConfigPath: ctd.HostsDir, From: ctrimport.FromCRIStatus}
					if d.v2 {
						want.From = ctrimport.FromIntrospection
						assert.Equal(t, strings.TrimPrefix(services.Containerd2Version, "v"), strings.TrimPrefix(rc.Version, "v"))
					} else {
						assert.True(t, strings.HasPrefix(rc.Version, "1.6"), rc.Version)
					}
					switch {
					case unset && d.v2:
						want.ConfigPath = "/etc/containerd/certs.d:/etc/docker/certs.d" // 2.x's default on Linux
					case unset:
						want.ConfigPath = ""
					}
					assert.Equal(t, want, rc)
					reads, why := rc.ReadsHostsDir(ctd.HostsDir)
					assert.Equal(t, !unset, reads, why)
					assert.Equal(t, reads, why == "", why)
				})
			}
		})
	}
}

// TestReadRegistryConfigUnreachable: a socket nobody listens on is an
// error, not ErrRegistryConfigUnreported.
func TestReadRegistryConfigUnreachable(t *testing.T) {
	t.Parallel()
	_, err := ctrimport.ReadRegistryConfig(t.Context(), filepath.Join(t.TempDir(), "none.sock"))
	require.Error(t, err)
	assert.NotErrorIs(t, err, ctrimport.ErrRegistryConfigUnreported)
}

// TestReadsHostsDirMatchesPulls checks ReadsHostsDir against what real
// daemons do: hosts.toml files written as the agent writes them
// (mirror.ConfigureHosts) for a registry whose name resolves nowhere point
// it at a real registry, so a CRI pull of it succeeds exactly when
// containerd reads them. config_path is the hosts directory, a list that
// holds it (1.6 reads it, 2.4's transfer service does not), a directory
// elsewhere, or unset.
func TestReadsHostsDirMatchesPulls(t *testing.T) {
	t.Parallel()
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	img, err := services.PushRandomImage(t.Context(), reg.Addr, "test/hosts", "v1", 1, 64<<10, nil)
	require.NoError(t, err)
	const registry = "registry.invalid"
	ref := strings.Replace(img.Ref, reg.Addr, registry, 1)
	for _, d := range daemons {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bins := binaries(t, d.v2)
			for _, tc := range []struct {
				name  string
				path  func(hostsDir, other string) string
				unset bool
				want  bool
			}{
				{name: "hosts dir", path: func(h, _ string) string { return h }, want: true},
				{name: "list", path: func(h, o string) string { return h + ":" + o }, want: !d.v2},
				{name: "elsewhere", path: func(_, o string) string { return o }},
				{name: "unset", unset: true},
			} {
				t.Run(tc.name, func(t *testing.T) {
					dir := t.TempDir()
					other := filepath.Join(dir, "other-certs.d")
					require.NoError(t, os.MkdirAll(other, 0o755))
					cfg := services.ContainerdConfig{Dir: filepath.Join(dir, "ctd"), Binaries: bins, NoConfigPath: tc.unset}
					if tc.path != nil {
						cfg.ConfigPath = tc.path(filepath.Join(cfg.Dir, "certs.d"), other)
					}
					ctd := services.NewContainerdT(t, cfg)
					require.NoError(t, mirror.ConfigureHosts(ctd.HostsDir, "http://"+reg.Addr, []string{registry}))

					rc, err := ctrimport.ReadRegistryConfig(t.Context(), ctd.Address)
					require.NoError(t, err)
					reads, why := rc.ReadsHostsDir(ctd.HostsDir)
					_, pullErr := ctd.PullImageCRI(t.Context(), ref)
					assert.Equal(t, tc.want, reads, "config_path %q: %s", rc.ConfigPath, why)
					assert.Equal(t, reads, pullErr == nil, "ReadsHostsDir says %v (%s), the pull: %v", reads, why, pullErr)
				})
			}
		})
	}
}

// TestReadsHostsDir covers what ReadsHostsDir makes of config paths.
func TestReadsHostsDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	hosts := filepath.Join(dir, "certs.d")
	link := filepath.Join(dir, "link")
	require.NoError(t, os.Mkdir(hosts, 0o755))
	require.NoError(t, os.Symlink(hosts, link))
	for _, tc := range []struct {
		name, version, path string
		want                bool
	}{
		{"same", "1.6.20", hosts, true},
		{"unclean", "v2.4.2", hosts + "/", true},
		{"through a link", "v2.4.2", link, true},
		{"unset", "1.6.20", "", false},
		{"unset 2.x", "v2.4.2", "", false},
		{"elsewhere", "1.6.20", "/etc/containerd/certs.d", false},
		{"1.x list, first", "1.7.27", hosts + ":/etc/docker/certs.d", true},
		{"1.x list, second", "1.6.20", "/etc/docker/certs.d:" + hosts, true},
		{"1.x list without", "1.6.20", "/etc/containerd/certs.d:/etc/docker/certs.d", false},
		{"2.x list", "v2.4.2", hosts + ":/etc/docker/certs.d", false},
		{"2.x default", "v2.4.2", "/etc/containerd/certs.d:/etc/docker/certs.d", false},
		{"empty entries", "1.6.20", ":" + hosts + ":", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rc := ctrimport.RegistryConfig{Version: tc.version, ConfigPath: tc.path}
			got, why := rc.ReadsHostsDir(hosts)
			assert.Equal(t, tc.want, got, why)
			assert.Equal(t, got, why == "", why)
		})
	}
}

func TestRegistryConfigTable(t *testing.T) {
	t.Parallel()
	assert.Equal(t, `[plugins."io.containerd.grpc.v1.cri".registry]`, ctrimport.RegistryConfigTable("1.6.20~ds1"))
	assert.Equal(t, `[plugins."io.containerd.grpc.v1.cri".registry]`, ctrimport.RegistryConfigTable("v1.7.27"))
	assert.Equal(t, `[plugins."io.containerd.cri.v1.images".registry]`, ctrimport.RegistryConfigTable("v2.4.2"))
	assert.Equal(t, `[plugins."io.containerd.cri.v1.images".registry]`, ctrimport.RegistryConfigTable("2.0.0"))
	assert.Empty(t, ctrimport.RegistryConfigTable(""))
	assert.Empty(t, ctrimport.RegistryConfigTable("v3.0.0"))
}
