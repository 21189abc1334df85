package mirror

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/cache"
)

func TestConfigureHosts(t *testing.T) {
	t.Parallel()
	const mirrorURL = "http://127.0.0.1:5001"
	const original = "server = \"https://quay.io\"\n[host.\"https://other-mirror\"]\n  capabilities = [\"pull\"]\n"
	tests := []struct {
		name       string
		registry   string
		existing   string // a hosts.toml there before; "" for none
		opts       []HostsOption
		wantServer string
		wantSkip   bool
	}{
		{name: "docker hub", registry: "docker.io", wantServer: `server = "https://registry-1.docker.io"`},
		{name: "other registry", registry: "quay.io", wantServer: `server = "https://quay.io"`},
		{name: "existing file", registry: "quay.io", existing: original, wantServer: `server = "https://quay.io"`},
		{name: "plain http test registry", registry: "127.0.0.1:5000", opts: []HostsOption{ServerURL("127.0.0.1:5000", "http://127.0.0.1:5000")},
			wantServer: `server = "http://127.0.0.1:5000"`},
		{name: "skip verify", registry: "localhost:5443", opts: []HostsOption{SkipVerify("localhost:5443")},
			wantServer: `server = "https://localhost:5443"`, wantSkip: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			root := t.TempDir()
			dir := filepath.Join(root, tt.registry)
			file, backup := filepath.Join(dir, "hosts.toml"), filepath.Join(dir, "hosts.toml.weightd-backup")
			if tt.existing != "" {
				require.NoError(t, os.MkdirAll(dir, 0o755))
				require.NoError(t, os.WriteFile(file, []byte(tt.existing), 0o644))
			}
			// Twice: configuring again must keep the first backup.
			for range 2 {
				require.NoError(t, ConfigureHosts(root, mirrorURL, []string{tt.registry}, tt.opts...))
			}
			b, err := os.ReadFile(file)
			require.NoError(t, err)
			got := string(b)
			assert.Contains(t, got, tt.wantServer+"\n")
			assert.Contains(t, got, "[host.\"http://127.0.0.1:5001\"]\n  capabilities = [\"pull\", \"resolve\"]\n")
			if tt.wantSkip {
				assert.Contains(t, got, "skip_verify = true\n")
			} else {
				assert.NotContains(t, got, "skip_verify")
			}
			if tt.existing != "" {
				bk, err := os.ReadFile(backup)
				require.NoError(t, err)
				assert.Equal(t, tt.existing, string(bk))
			} else {
				assert.NoFileExists(t, backup)
			}
			entries, err := os.ReadDir(dir)
			require.NoError(t, err)
			for _, e := range entries {
				assert.Contains(t, []string{"hosts.toml", "hosts.toml.weightd-backup"}, e.Name(), "no temporary file left")
			}

			require.NoError(t, RestoreHosts(root, []string{tt.registry}))
			if tt.existing != "" {
				b, err := os.ReadFile(file)
				require.NoError(t, err)
				assert.Equal(t, tt.existing, string(b))
				assert.NoFileExists(t, backup)
			} else {
				assert.NoDirExists(t, dir)
			}
			require.NoError(t, RestoreHosts(root, []string{tt.registry}), "restoring twice is harmless")
		})
	}
}

func TestConfigureHostsKeepsFirstBackup(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	dir := filepath.Join(root, "quay.io")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hosts.toml"), []byte("# first\n"), 0o644))
	require.NoError(t, ConfigureHosts(root, "http://127.0.0.1:5001", []string{"quay.io"}))
	// Someone replaces our file; configuring again must not lose the first.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hosts.toml"), []byte("# second\n"), 0o644))
	require.NoError(t, ConfigureHosts(root, "http://127.0.0.1:5001", []string{"quay.io"}))
	require.NoError(t, RestoreHosts(root, []string{"quay.io"}))
	b, err := os.ReadFile(filepath.Join(dir, "hosts.toml"))
	require.NoError(t, err)
	assert.Equal(t, "# first\n", string(b))
}

func TestRestoreHostsLeavesForeignFile(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	dir := filepath.Join(root, "quay.io")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hosts.toml"), []byte("# theirs\n"), 0o644))
	require.NoError(t, RestoreHosts(root, []string{"quay.io"}))
	b, err := os.ReadFile(filepath.Join(dir, "hosts.toml"))
	require.NoError(t, err)
	assert.Equal(t, "# theirs\n", string(b))
}

func TestConfigureHostsRejects(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	tests := []struct {
		name      string
		mirror    string
		registers []string
		opts      []HostsOption
	}{
		{"path in registry", "http://127.0.0.1:5001", []string{"../etc"}, nil},
		{"slash in registry", "http://127.0.0.1:5001", []string{"a/b"}, nil},
		{"empty registry", "http://127.0.0.1:5001", []string{""}, nil},
		{"bad port", "http://127.0.0.1:5001", []string{"quay.io:99999"}, nil},
		{"mirror scheme", "ftp://127.0.0.1:5001", []string{"quay.io"}, nil},
		{"mirror quote", "http://127.0.0.1:5001/\"]", []string{"quay.io"}, nil},
		{"mirror query", "http://127.0.0.1:5001/?x=1", []string{"quay.io"}, nil},
		{"server newline", "http://127.0.0.1:5001", []string{"quay.io"}, []HostsOption{ServerURL("quay.io", "http://a\n")}},
		{"server registry", "http://127.0.0.1:5001", []string{"quay.io"}, []HostsOption{ServerURL("a b", "http://a")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := ConfigureHosts(root, tt.mirror, tt.registers, tt.opts...)
			assert.ErrorIs(t, err, cache.ErrInvalid)
		})
	}
	entries, err := os.ReadDir(root)
	require.NoError(t, err)
	assert.Empty(t, entries, "nothing written")
	assert.ErrorIs(t, RestoreHosts(root, []string{"../x"}), cache.ErrInvalid)
}
