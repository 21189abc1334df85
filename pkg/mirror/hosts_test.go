package mirror

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	ctdconfig "github.com/containerd/containerd/v2/core/remotes/docker/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

func TestConfigureHosts(t *testing.T) {
	t.Parallel()
	const mirrorURL = "http://127.0.0.1:5001"
	const original = "server = \"https://quay.io\"\n[host.\"https://other-mirror\"]\n  capabilities = [\"pull\"]\n"
	const mirrorTable = "[host.'http://127.0.0.1:5001']\ncapabilities = ['pull', 'resolve']\ndial_timeout = '200ms'\n"
	tests := []struct {
		name       string
		registry   string
		existing   string // a hosts.toml there before; "" for none
		opts       []HostsOption
		wantServer string
		wantSkip   bool
	}{
		{name: "docker hub", registry: "docker.io", wantServer: `server = 'https://registry-1.docker.io'`},
		{name: "other registry", registry: "quay.io", wantServer: `server = 'https://quay.io'`},
		{name: "existing file", registry: "quay.io", existing: original, wantServer: `server = 'https://quay.io'`},
		{name: "plain http test registry", registry: "127.0.0.1:5000", opts: []HostsOption{ServerURL("127.0.0.1:5000", "http://127.0.0.1:5000")},
			wantServer: `server = 'http://127.0.0.1:5000'`},
		{name: "skip verify", registry: "localhost:5443", opts: []HostsOption{SkipVerify("localhost:5443")},
			wantServer: `server = 'https://localhost:5443'`, wantSkip: true},
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
			assert.Contains(t, got, mirrorTable)
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
			assert.ErrorIs(t, err, content.ErrInvalid)
		})
	}
	entries, err := os.ReadDir(root)
	require.NoError(t, err)
	assert.Empty(t, entries, "nothing written")
	assert.ErrorIs(t, RestoreHosts(root, []string{"../x"}), content.ErrInvalid)
}

// corporateHosts is a node's hosts.toml for a registry it pulls through a
// corporate mirror with its own CA (a path relative to the file's
// directory), a client certificate and a header, then an air-gapped one.
const corporateHosts = `server = "https://quay.io"
ca = "quay-ca.pem"

[host."https://127.0.0.1:8443/v2/quay"]
  capabilities = ["pull", "resolve"]
  ca = ["corp-ca.pem", "%s"]
  client = [["client.cert", "client.key"]]
  skip_verify = false
  override_path = true
  dial_timeout = "3s"
  [host."https://127.0.0.1:8443/v2/quay".header]
    X-Corp-Token = ["a", "b"]

[host."http://air.gap:5000"]
  capabilities = ["pull"]
`

// TestConfigureHostsMerges: weightd's mirror comes first, then the node's
// own hosts and server with every setting kept, and containerd 2.4.2's own
// reader (core/remotes/docker/config) sees exactly the node's hosts behind
// the mirror, CA pools and client certificates included. Configuring again
// (an agent restart, an upgrade) writes the same file; restoring puts the
// original back byte for byte.
func TestConfigureHostsMerges(t *testing.T) {
	t.Parallel()
	const mirrorURL = "http://127.0.0.1:5001"
	certs := writeTestPKI(t)
	root := t.TempDir()
	dir := filepath.Join(root, "quay.io")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	for _, name := range []string{"quay-ca.pem", "corp-ca.pem"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), certs.caPEM, 0o644))
	}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "client.cert"), certs.certPEM, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "client.key"), certs.keyPEM, 0o600))
	original := fmt.Sprintf(corporateHosts, certs.otherCA)
	file := filepath.Join(dir, "hosts.toml")
	require.NoError(t, os.WriteFile(file, []byte(original), 0o644))
	before := containerdHosts(t, root, "quay.io")
	require.Len(t, before, 3)
	require.Len(t, before[0].RootCAs, 2, "containerd read both CAs of the corporate mirror")
	require.Equal(t, 1, before[0].ClientCerts)

	require.NoError(t, ConfigureHosts(root, mirrorURL, []string{"quay.io"}))
	merged, err := os.ReadFile(file)
	require.NoError(t, err)
	want := hostsMarker + "\n" +
		"ca = '" + dir + "/quay-ca.pem'\n" +
		"server = 'https://quay.io'\n\n" +
		"[host.'http://127.0.0.1:5001']\ncapabilities = ['pull', 'resolve']\ndial_timeout = '200ms'\n\n" +
		"[host.'https://127.0.0.1:8443/v2/quay']\n" +
		"ca = ['" + dir + "/corp-ca.pem', '" + certs.otherCA + "']\n" +
		"capabilities = ['pull', 'resolve']\n" +
		"client = [['" + dir + "/client.cert', '" + dir + "/client.key']]\n" +
		"dial_timeout = '3s'\noverride_path = true\nskip_verify = false\n\n" +
		"[host.'https://127.0.0.1:8443/v2/quay'.header]\nX-Corp-Token = ['a', 'b']\n\n" +
		"[host.'http://air.gap:5000']\ncapabilities = ['pull']\n"
	assert.Equal(t, want, string(merged))

	after := containerdHosts(t, root, "quay.io")
	require.Len(t, after, 4)
	assert.Equal(t, hostView{Scheme: "http", Host: "127.0.0.1:5001", Path: "/v2", Capabilities: docker.HostCapabilityPull | docker.HostCapabilityResolve}, after[0])
	assert.Equal(t, before, after[1:], "the node's hosts, as containerd reads them, behind the mirror")

	require.NoError(t, ConfigureHosts(root, mirrorURL, []string{"quay.io"}))
	again, err := os.ReadFile(file)
	require.NoError(t, err)
	assert.Equal(t, string(merged), string(again), "configuring again changes nothing")

	require.NoError(t, RestoreHosts(root, []string{"quay.io"}))
	restored, err := os.ReadFile(file)
	require.NoError(t, err)
	assert.Equal(t, original, string(restored))
}

// TestConfigureHostsUpgradesOwnFile: a hosts.toml written by an earlier
// weightd, which replaced the node's file rather than merging it, is
// rewritten from the backup, so an upgrade brings the node's hosts back.
func TestConfigureHostsUpgradesOwnFile(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	dir := filepath.Join(root, "quay.io")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	const original = "server = \"https://quay.io\"\n[host.\"https://corp.example\"]\n  capabilities = [\"pull\"]\n"
	const earlier = hostsMarker + "\nserver = \"https://quay.io\"\n\n[host.\"http://127.0.0.1:5001\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hosts.toml.weightd-backup"), []byte(original), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "hosts.toml"), []byte(earlier), 0o644))
	require.NoError(t, ConfigureHosts(root, "http://127.0.0.1:5001", []string{"quay.io"}))
	b, err := os.ReadFile(filepath.Join(dir, "hosts.toml"))
	require.NoError(t, err)
	assert.Equal(t, hostsMarker+"\nserver = 'https://quay.io'\n\n"+
		"[host.'http://127.0.0.1:5001']\ncapabilities = ['pull', 'resolve']\ndial_timeout = '200ms'\n\n"+
		"[host.'https://corp.example']\ncapabilities = ['pull']\n", string(b))
}

// TestConfigureHostsRefusesUnreadable: a node's hosts.toml that containerd
// itself would not read is left as it is, with an error saying what is
// wrong, and the other registries are still configured.
func TestConfigureHostsRefusesUnreadable(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, file, wantErr string }{
		{"not toml", "server = \n", "invalid"},
		{"server type", "server = 5\n", "server is a number"},
		{"capability", "[host.\"https://a\"]\ncapabilities = [\"delete\"]\n", `unknown capability "delete"`},
		{"ca type", "ca = 5\n", "ca: is a number"},
		{"client pair", "client = [[\"a\", \"b\", \"c\"]]\n", "client: holds a list of 3"},
		{"dial timeout", "[host.\"https://a\"]\ndial_timeout = \"soon\"\n", "dial_timeout"},
		{"header type", "[host.\"https://a\".header]\nX = 1\n", "X is a number"},
		{"skip_verify type", "skip_verify = \"yes\"\n", "skip_verify: is a string"},
		{"host not tables", "host = 1\n", "host is a number"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			root := t.TempDir()
			dir := filepath.Join(root, "quay.io")
			require.NoError(t, os.MkdirAll(dir, 0o755))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "hosts.toml"), []byte(tt.file), 0o644))
			err := ConfigureHosts(root, "http://127.0.0.1:5001", []string{"quay.io", "ghcr.io"})
			require.ErrorIs(t, err, content.ErrInvalid)
			assert.ErrorContains(t, err, tt.wantErr)
			assert.ErrorContains(t, err, "quay.io")
			b, rerr := os.ReadFile(filepath.Join(dir, "hosts.toml"))
			require.NoError(t, rerr)
			assert.Equal(t, tt.file, string(b), "left as it was")
			assert.NoFileExists(t, filepath.Join(dir, "hosts.toml.weightd-backup"))
			assert.FileExists(t, filepath.Join(root, "ghcr.io", "hosts.toml"))
		})
	}
}

// hostView is what containerd made of one host of a hosts.toml.
type hostView struct {
	Scheme, Host, Path string
	Capabilities       docker.HostCapabilities
	Header             http.Header
	RootCAs            []string // subjects beyond the system's, in pool order
	ClientCerts        int
	SkipVerify         bool
}

// containerdHosts is the host list containerd 2.4.2 makes of root's
// hosts.toml for registry.
func containerdHosts(t testing.TB, root, registry string) []hostView {
	t.Helper()
	hosts, err := containerdHostsErr(root, registry)
	require.NoError(t, err)
	return hosts
}

func containerdHostsErr(root, registry string) ([]hostView, error) {
	hosts, err := ctdconfig.ConfigureHosts(context.Background(), ctdconfig.HostOptions{HostDir: ctdconfig.HostDirFromRoot(root)})(registry)
	if err != nil {
		return nil, err
	}
	system := map[string]bool{}
	if pool, err := x509.SystemCertPool(); err == nil {
		//nolint:staticcheck // Subjects lists a pool built from files, which is all this compares.
		for _, s := range pool.Subjects() {
			system[string(s)] = true
		}
	}
	var out []hostView
	for _, h := range hosts {
		v := hostView{Scheme: h.Scheme, Host: h.Host, Path: h.Path, Capabilities: h.Capabilities, Header: h.Header}
		if tr, ok := h.Client.Transport.(*http.Transport); ok && tr.TLSClientConfig != nil {
			c := tr.TLSClientConfig
			if c.RootCAs != nil {
				//nolint:staticcheck // Subjects lists a pool built from files, which is all this compares.
				for _, s := range c.RootCAs.Subjects() {
					if !system[string(s)] {
						v.RootCAs = append(v.RootCAs, string(s))
					}
				}
			}
			v.ClientCerts, v.SkipVerify = len(c.Certificates), c.InsecureSkipVerify
		}
		out = append(out, v)
	}
	return out, nil
}

// testPKI is a CA and a client certificate, as PEM.
type testPKI struct {
	caPEM, certPEM, keyPEM []byte
	otherCA                string // an absolute path to a second CA
}

func writeTestPKI(t *testing.T) testPKI {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	pemOf := func(subject string, isCA bool) []byte {
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: subject},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: isCA, BasicConstraintsValid: true}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		require.NoError(t, err)
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	p := testPKI{caPEM: pemOf("corp CA", true), certPEM: pemOf("node", false),
		keyPEM: pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})}
	p.otherCA = filepath.Join(t.TempDir(), "other-ca.pem")
	require.NoError(t, os.WriteFile(p.otherCA, pemOf("other CA", true), 0o644))
	return p
}
