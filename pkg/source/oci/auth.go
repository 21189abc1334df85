package oci

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source/internal/fetch"
)

// RegistryAuth is whose credentials a request to a registry carries: the
// client's own (HTTP basic, as containerd sends a pull secret's to the
// registry mirror), else the agent's own where Agent is set, else none.
type RegistryAuth struct {
	Username, Password string
	// Agent lets a request without the client's own credentials carry the
	// agent's (its pull secrets and Docker config), where it has some for
	// the registry.
	Agent bool
}

// Own reports whether the request carries the client's own credentials.
func (a RegistryAuth) Own() bool { return a.Username != "" || a.Password != "" }

// Key names the credentials, for caches of what they were allowed: the
// password is hashed, never kept in a key.
func (a RegistryAuth) Key() string {
	switch {
	case a.Own():
		sum := sha256.Sum256([]byte(a.Username + "\x00" + a.Password))
		return "basic:" + hex.EncodeToString(sum[:])
	case a.Agent:
		return "agent"
	}
	return "anonymous"
}

// anonymous reports whether requests with auth for repo carry no
// credentials at all: what they fetch, anyone may.
func (s *Source) anonymous(auth RegistryAuth, repo name.Repository) (bool, error) {
	if auth.Own() {
		return false, nil
	}
	if !auth.Agent {
		return true, nil
	}
	a, err := s.keychain.Resolve(repo)
	if err != nil {
		return false, content.Permanent(fmt.Errorf("looking up credentials for %s: %w", repo, err))
	}
	return a == authn.Anonymous, nil
}

// authenticator is what requests with auth for repo authenticate with.
func (s *Source) authenticator(auth RegistryAuth, repo name.Repository) (authn.Authenticator, error) {
	switch {
	case auth.Own():
		return authn.FromConfig(authn.AuthConfig{Username: auth.Username, Password: auth.Password}), nil
	case auth.Agent:
		return s.keychain.Resolve(repo)
	}
	return authn.Anonymous, nil
}

// dockerKeychain is an authn.Keychain over pull secrets and Docker config
// files: the first pull secret with credentials for the registry, else the
// first file, else anonymous.
type dockerKeychain struct {
	secrets []dockerAuths
	files   []string
}

// dockerAuths is the parsed "auths" of one Docker config, or why it did
// not parse.
type dockerAuths struct {
	auths map[string]dockerAuth
	err   error
}

// dockerAuth is one entry of a Docker config's "auths".
type dockerAuth struct {
	Auth          string `json:"auth"`
	Username      string `json:"username"`
	Password      string `json:"password"`
	IdentityToken string `json:"identitytoken"`
	RegistryToken string `json:"registrytoken"`
}

// Resolve implements authn.Keychain.
func (k *dockerKeychain) Resolve(r authn.Resource) (authn.Authenticator, error) {
	for _, s := range k.secrets {
		if s.err != nil {
			return nil, s.err
		}
		if a, ok, err := lookupAuth(s.auths, r); err != nil || ok {
			return a, err
		}
	}
	for _, f := range k.files {
		data, err := os.ReadFile(f)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading Docker config: %w", err)
		}
		auths, err := parseDockerConfig(data)
		if err != nil {
			return nil, fmt.Errorf("reading Docker config %s: %w", f, err)
		}
		if a, ok, err := lookupAuth(auths, r); err != nil || ok {
			return a, err
		}
	}
	return authn.Anonymous, nil
}

// parseDockerConfig parses a Docker config.json ({"auths": {...}}) or the
// older .dockercfg (the map of registries alone).
func parseDockerConfig(data []byte) (map[string]dockerAuth, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		return nil, fmt.Errorf("%w: not a Docker config: %v", content.ErrInvalid, err)
	}
	raw, ok := top["auths"]
	if !ok {
		if !isDockercfg(top) {
			return nil, nil // a config.json without auths
		}
		raw = data
	}
	var auths map[string]dockerAuth
	if err := json.Unmarshal(raw, &auths); err != nil {
		return nil, fmt.Errorf("%w: Docker config auths: %v", content.ErrInvalid, err)
	}
	return auths, nil
}

// isDockercfg reports whether a config without "auths" is the older
// .dockercfg: registries mapped to objects, none of the keys the Docker
// CLI's config.json has besides "auths".
func isDockercfg(top map[string]json.RawMessage) bool {
	if len(top) == 0 {
		return false
	}
	for k, v := range top {
		switch k {
		case "credsStore", "credHelpers", "HttpHeaders", "proxies", "plugins", "aliases", "features", "currentContext", "psFormat", "imagesFormat", "detachKeys", "experimental":
			return false
		}
		if v = bytes.TrimSpace(v); len(v) == 0 || v[0] != '{' {
			return false
		}
	}
	return true
}

// lookupAuth finds the credentials for r among auths, kubelet's way: keys
// may have a scheme, a path (a prefix of the repository) and '*' globs in
// host labels; the longest matching key wins; Docker Hub is known by all its
// names.
func lookupAuth(auths map[string]dockerAuth, r authn.Resource) (authn.Authenticator, bool, error) {
	reg := r.RegistryStr()
	repoPath := strings.TrimPrefix(strings.TrimPrefix(r.String(), reg), "/")
	best, bestLen := "", -1
	for key := range auths {
		host, keyPath := normalizeAuthKey(key)
		if !hostMatches(host, reg) {
			continue
		}
		if keyPath != "" && repoPath != keyPath && !strings.HasPrefix(repoPath, keyPath+"/") {
			continue
		}
		if l := len(host) + len(keyPath); l > bestLen || (l == bestLen && key < best) {
			best, bestLen = key, l
		}
	}
	if bestLen < 0 {
		return nil, false, nil
	}
	e := auths[best]
	cfg := authn.AuthConfig{Username: e.Username, Password: e.Password, IdentityToken: e.IdentityToken, RegistryToken: e.RegistryToken}
	if e.Auth != "" {
		dec, err := base64.StdEncoding.DecodeString(e.Auth)
		if err != nil {
			return nil, false, fmt.Errorf("%w: credentials for %q: auth is not base64", content.ErrInvalid, fetch.Truncate(best))
		}
		user, pass, ok := strings.Cut(string(dec), ":")
		if !ok {
			return nil, false, fmt.Errorf("%w: credentials for %q: auth is not user:password", content.ErrInvalid, fetch.Truncate(best))
		}
		cfg.Username, cfg.Password = user, pass
	}
	return authn.FromConfig(cfg), true, nil
}

// normalizeAuthKey splits a Docker config key into its host (lower case,
// Docker Hub as index.docker.io) and repository path prefix.
func normalizeAuthKey(key string) (host, keyPath string) {
	k := strings.ToLower(key)
	k = strings.TrimPrefix(strings.TrimPrefix(k, "https://"), "http://")
	host, keyPath, _ = strings.Cut(k, "/")
	keyPath = strings.Trim(path.Clean("/"+keyPath), "/")
	switch host {
	case "docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com":
		host = name.DefaultRegistry
		if keyPath == "v1" || keyPath == "v2" {
			keyPath = ""
		}
	}
	return host, keyPath
}

// hostMatches matches a registry host[:port] against a key host that may
// have '*' globs in its labels (kubelet's rule: as many labels, each
// matching, same port).
func hostMatches(pattern, host string) bool {
	if pattern == host {
		return true
	}
	if !strings.Contains(pattern, "*") {
		return false
	}
	ph, pp := splitPort(pattern)
	hh, hp := splitPort(host)
	if pp != hp {
		return false
	}
	pl, hl := strings.Split(ph, "."), strings.Split(hh, ".")
	if len(pl) != len(hl) {
		return false
	}
	for i := range pl {
		if ok, err := path.Match(pl[i], hl[i]); err != nil || !ok {
			return false
		}
	}
	return true
}

func splitPort(hostport string) (host, port string) {
	if h, p, err := net.SplitHostPort(hostport); err == nil {
		return h, p
	}
	return hostport, ""
}
