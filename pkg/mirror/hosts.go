package mirror

import (
	"bytes"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/weightd/weightd/pkg/cache"
)

// Files ConfigureHosts manages in <configPath>/<host>/.
const (
	hostsFile   = "hosts.toml"
	backupFile  = "hosts.toml.weightd-backup"
	hostsMarker = "# Written by weightd: pulls go through the node's registry mirror, then to the server."
)

// dockerHubServer is Docker Hub's real registry endpoint.
const dockerHubServer = "https://registry-1.docker.io"

// HostsOption configures ConfigureHosts.
type HostsOption func(*hostsOptions) error

type hostsOptions struct {
	servers    map[string]string // registry → server URL
	skipVerify map[string]bool
}

// ServerURL sets the upstream server containerd falls back to for registry
// (default https://<registry>, and https://registry-1.docker.io for
// docker.io): "http://127.0.0.1:5000" for a plain-HTTP test registry.
func ServerURL(registry, serverURL string) HostsOption {
	return func(o *hostsOptions) error {
		h, ok := canonicalHost(registry)
		if !ok {
			return fmt.Errorf("%w: registry %q is not a host[:port]", cache.ErrInvalid, registry)
		}
		if err := validateURL(serverURL); err != nil {
			return fmt.Errorf("server of %s: %w", registry, err)
		}
		o.servers[h] = serverURL
		return nil
	}
}

// SkipVerify makes containerd accept the upstream server of registry without
// verifying its TLS certificate (a test registry with a self-signed one).
func SkipVerify(registry string) HostsOption {
	return func(o *hostsOptions) error {
		h, ok := canonicalHost(registry)
		if !ok {
			return fmt.Errorf("%w: registry %q is not a host[:port]", cache.ErrInvalid, registry)
		}
		o.skipVerify[h] = true
		return nil
	}
}

// ConfigureHosts points containerd's pulls from each registry at the mirror:
// it writes <configPath>/<registry>/hosts.toml (containerd's
// registry.config_path) with the mirror at mirrorURL as the first host,
// for pull and resolve, and the registry's own server as the fallback
// containerd uses when the agent is down. A hosts.toml that was there
// before, not written by weightd, is kept once as hosts.toml.weightd-backup
// (an existing backup is never overwritten), for RestoreHosts. Files are
// written atomically. Registries are host[:port]; "docker.io" for Docker Hub.
func ConfigureHosts(configPath string, mirrorURL string, registries []string, opts ...HostsOption) error {
	o := hostsOptions{servers: map[string]string{}, skipVerify: map[string]bool{}}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return err
		}
	}
	if err := validateURL(mirrorURL); err != nil {
		return fmt.Errorf("mirror: %w", err)
	}
	hosts, err := hostDirs(registries)
	if err != nil {
		return err
	}
	for _, h := range hosts {
		if err := configureHost(filepath.Join(configPath, h), h, mirrorURL, o); err != nil {
			return fmt.Errorf("configuring containerd hosts for %s: %w", h, err)
		}
	}
	return nil
}

func configureHost(dir, host, mirrorURL string, o hostsOptions) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	path := filepath.Join(dir, hostsFile)
	old, err := os.ReadFile(path)
	switch {
	case err == nil && !isOurs(old):
		if err := keepBackup(filepath.Join(dir, backupFile), old); err != nil {
			return err
		}
	case err != nil && !errors.Is(err, os.ErrNotExist):
		return err
	}
	server := o.servers[host]
	if server == "" {
		server = "https://" + host
		if host == "docker.io" {
			server = dockerHubServer
		}
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "%s\n", hostsMarker)
	fmt.Fprintf(&b, "server = %q\n", server)
	if o.skipVerify[host] {
		b.WriteString("skip_verify = true\n")
	}
	fmt.Fprintf(&b, "\n[host.%q]\n", mirrorURL)
	b.WriteString("  capabilities = [\"pull\", \"resolve\"]\n")
	return cache.WriteFileAtomic(path, b.Bytes(), 0o644)
}

// keepBackup saves the original hosts.toml once: an existing backup is the
// original and is never replaced.
func keepBackup(path string, b []byte) error {
	if _, err := os.Lstat(path); err == nil {
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+backupFile+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	// A hard link does not replace an existing file: a backup made
	// meanwhile wins.
	if err := os.Link(tmp, path); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	return cache.SyncDir(filepath.Dir(path))
}

// RestoreHosts undoes ConfigureHosts for each registry: the backed-up
// hosts.toml is put back, or, where there was none, the one weightd wrote is
// removed. A hosts.toml weightd did not write is left alone.
func RestoreHosts(configPath string, registries []string) error {
	hosts, err := hostDirs(registries)
	if err != nil {
		return err
	}
	var errs []error
	for _, h := range hosts {
		if err := restoreHost(filepath.Join(configPath, h)); err != nil {
			errs = append(errs, fmt.Errorf("restoring containerd hosts for %s: %w", h, err))
		}
	}
	return errors.Join(errs...)
}

func restoreHost(dir string) error {
	path, backup := filepath.Join(dir, hostsFile), filepath.Join(dir, backupFile)
	if _, err := os.Lstat(backup); err == nil {
		if err := os.Rename(backup, path); err != nil {
			return err
		}
		return cache.SyncDir(dir)
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if !isOurs(b) {
		return nil
	}
	if err := os.Remove(path); err != nil {
		return err
	}
	// The directory goes too when it holds nothing else (ours, most likely).
	if err := os.Remove(dir); err == nil {
		return cache.SyncDir(filepath.Dir(dir))
	}
	return cache.SyncDir(dir)
}

func isOurs(b []byte) bool { return bytes.HasPrefix(b, []byte(hostsMarker+"\n")) }

// hostDirs validates registry hosts, which become directory names.
func hostDirs(registries []string) ([]string, error) {
	var out []string
	for _, r := range registries {
		h, ok := canonicalHost(r)
		if !ok || strings.ContainsAny(h, `/\`) {
			return nil, fmt.Errorf("%w: registry %q is not a host[:port]", cache.ErrInvalid, r)
		}
		out = append(out, h)
	}
	return out, nil
}

// validateURL accepts http(s)://host[:port] with at most a path: what
// containerd takes as a host, and safe inside a TOML string.
func validateURL(s string) error {
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%w: URL %q: %v", cache.ErrInvalid, s, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil ||
		u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
		return fmt.Errorf("%w: URL %q: want http(s)://host[:port]", cache.ErrInvalid, s)
	}
	if _, ok := canonicalHost(u.Host); !ok {
		return fmt.Errorf("%w: URL %q: bad host", cache.ErrInvalid, s)
	}
	for _, c := range s {
		if c < 0x21 || c > 0x7e || c == '"' || c == '\\' {
			return fmt.Errorf("%w: URL %q: character %q", cache.ErrInvalid, s, c)
		}
	}
	return nil
}
