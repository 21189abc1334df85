package mirror

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// Files ConfigureHosts manages in <configPath>/<host>/.
const (
	hostsFile   = "hosts.toml"
	backupFile  = "hosts.toml.weightd-backup"
	hostsMarker = "# Written by weightd: pulls go through the node's registry mirror, then to the server."
)

// maxHostsFile bounds the hosts.toml read for merging: real ones are a
// few hundred bytes.
const maxHostsFile = 1 << 20

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
// docker.io): "http://127.0.0.1:5000" for a plain-HTTP test registry. A
// hosts.toml already there keeps its own server instead.
func ServerURL(registry, serverURL string) HostsOption {
	return func(o *hostsOptions) error {
		h, ok := canonicalHost(registry)
		if !ok {
			return fmt.Errorf("%w: registry %q is not a host[:port]", content.ErrInvalid, registry)
		}
		if err := validateURL(serverURL); err != nil {
			return fmt.Errorf("server of %s: %w", registry, err)
		}
		o.servers[h] = serverURL
		return nil
	}
}

// SkipVerify makes containerd accept the upstream server of registry without
// verifying its TLS certificate (a test registry with a self-signed one),
// unless a hosts.toml already there says how to reach it.
func SkipVerify(registry string) HostsOption {
	return func(o *hostsOptions) error {
		h, ok := canonicalHost(registry)
		if !ok {
			return fmt.Errorf("%w: registry %q is not a host[:port]", content.ErrInvalid, registry)
		}
		o.skipVerify[h] = true
		return nil
	}
}

// ConfigureHosts points containerd's pulls from each registry at the mirror:
// it writes <configPath>/<registry>/hosts.toml (containerd's
// registry.config_path) with the mirror at mirrorURL as the first host, for
// pull and resolve, with a short dial_timeout (mirrorDialTimeout). A
// hosts.toml that was there before, not written by weightd, is merged
// behind it: its [host] tables follow the mirror in their order, with their
// settings as they were (relative ca and client paths made absolute, as
// containerd resolves them), then its server with its settings, as the
// last fallback; ServerURL and SkipVerify apply only where there was none.
// That file is kept once as hosts.toml.weightd-backup (an existing backup
// is never overwritten), for RestoreHosts, and is what a later
// ConfigureHosts merges again when the hosts.toml is weightd's own, so
// configuring twice writes the same file. Files are written atomically. A
// registry whose file cannot be merged (see ErrInvalid) is left as it was
// and reported; the others are configured. Registries are host[:port];
// "docker.io" for Docker Hub.
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
	var errs []error
	for _, h := range hosts {
		if err := configureHost(filepath.Join(configPath, h), h, mirrorURL, o); err != nil {
			errs = append(errs, fmt.Errorf("configuring containerd hosts for %s: %w", h, err))
		}
	}
	return errors.Join(errs...)
}

func configureHost(dir, host, mirrorURL string, o hostsOptions) error {
	path, backup := filepath.Join(dir, hostsFile), filepath.Join(dir, backupFile)
	current, err := readHostsFile(path)
	if err != nil {
		return err
	}
	// The node's own configuration: the file there, or, when that is ours,
	// the one it replaced.
	original := current
	if current != nil && isOurs(current) {
		if original, err = readHostsFile(backup); err != nil {
			return err
		}
	}
	var doc hostsDoc
	if original != nil {
		absDir, err := filepath.Abs(dir)
		if err != nil {
			return err
		}
		if doc, err = parseHostsFile(original, absDir); err != nil {
			return fmt.Errorf("merging %s: %w", path, err)
		}
	} else {
		doc.top = map[string]any{"server": defaultServer(host, o)}
		if o.skipVerify[host] {
			doc.top["skip_verify"] = true
		}
	}
	out, err := doc.withMirror(mirrorURL).marshal()
	if err != nil {
		return fmt.Errorf("merging %s: %w", path, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if current != nil && !isOurs(current) {
		if err := keepBackup(backup, current); err != nil {
			return err
		}
	}
	return cache.WriteFileAtomic(path, out, 0o644)
}

// readHostsFile reads a hosts.toml, nil if there is none.
func readHostsFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxHostsFile+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxHostsFile {
		return nil, fmt.Errorf("%w: %s is over %d bytes", content.ErrInvalid, path, maxHostsFile)
	}
	return b, nil
}

// defaultServer is where containerd goes for host without a hosts.toml.
func defaultServer(host string, o hostsOptions) string {
	if s := o.servers[host]; s != "" {
		return s
	}
	if host == "docker.io" {
		return dockerHubServer
	}
	return "https://" + host
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
			return nil, fmt.Errorf("%w: registry %q is not a host[:port]", content.ErrInvalid, r)
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
		return fmt.Errorf("%w: URL %q: %v", content.ErrInvalid, s, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil ||
		u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
		return fmt.Errorf("%w: URL %q: want http(s)://host[:port]", content.ErrInvalid, s)
	}
	if _, ok := canonicalHost(u.Host); !ok {
		return fmt.Errorf("%w: URL %q: bad host", content.ErrInvalid, s)
	}
	for _, c := range s {
		if c < 0x21 || c > 0x7e || c == '"' || c == '\\' {
			return fmt.Errorf("%w: URL %q: character %q", content.ErrInvalid, s, c)
		}
	}
	return nil
}
