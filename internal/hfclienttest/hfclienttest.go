// Package hfclienttest reads a Hugging Face hub cache with a real client
// library of the hub, the official JavaScript one (@huggingface/hub from the
// npm registry, run by Node), so tests can check that what weightd lays out
// is what the hub's own clients read: repositories found by name, branches
// and tags through refs/, files through snapshots/<commit>/.
//
// Install installs the library once into a cache directory keyed by its
// version; ReadCache runs a small script (offline.cjs) that reads a cache
// with the library's own functions, offline. Require skips a test where
// node or npm is missing, except under CI=true, where it fails it.
package hfclienttest

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

// Version is the release of @huggingface/hub installed and run.
const Version = "2.17.5"

// Package is the npm package.
const Package = "@huggingface/hub"

//go:embed offline.cjs
var offlineScript []byte

// Available says why the library cannot be run here, or nil: it needs node
// and npm on PATH.
func Available() error {
	var errs []error
	for _, b := range []string{"node", "npm"} {
		if _, err := exec.LookPath(b); err != nil {
			errs = append(errs, fmt.Errorf("%s not installed (apt-get install nodejs npm)", b))
		}
	}
	return errors.Join(errs...)
}

// Dir returns the directory Version is installed into and reused from:
// $WEIGHTD_NPM_CACHE/npm-hf-hub-<version> when that variable is set, else
// $HOME/.cache/weightd/npm-hf-hub-<version>.
func Dir() (string, error) {
	base := os.Getenv("WEIGHTD_NPM_CACHE")
	if base == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("finding the npm cache directory: %w (set WEIGHTD_NPM_CACHE)", err)
		}
		base = filepath.Join(home, ".cache", "weightd")
	}
	return filepath.Join(base, "npm-hf-hub-"+Version), nil
}

// installed reports whether dir holds the package at Version.
func installed(dir string) bool {
	b, err := os.ReadFile(filepath.Join(dir, "node_modules", "@huggingface", "hub", "package.json"))
	if err != nil {
		return false
	}
	var pkg struct {
		Version string `json:"version"`
	}
	return json.Unmarshal(b, &pkg) == nil && pkg.Version == Version
}

// Install returns the directory holding node_modules/@huggingface/hub at
// Version, installing it from the npm registry (`npm install --prefix DIR
// @huggingface/hub@<Version>`, its dependencies as its package.json ranges
// allow) unless it is there already. It installs into a temporary directory
// beside Dir and renames it into place, so an interrupted install never
// passes for a complete one; a lock file (Dir + ".lock") makes concurrent
// callers (test binaries) install once. npm's output is in the error of a
// failed install.
func Install(ctx context.Context) (string, error) {
	dir, err := Dir()
	if err != nil {
		return "", err
	}
	if installed(dir) {
		return dir, nil
	}
	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", err
	}
	defer lock.Close() // releases the flock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("locking %s: %w", lock.Name(), err)
	}
	if installed(dir) { // another process installed it while this one waited
		return dir, nil
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(dir)+"-install-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	cmd := exec.CommandContext(ctx, "npm", "install", "--prefix", tmp, "--no-audit", "--no-fund", Package+"@"+Version)
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("installing %s@%s (npm install): %w\n%s", Package, Version, err, out)
	}
	if !installed(tmp) {
		return "", fmt.Errorf("installing %s@%s: npm install left no package.json of version %s", Package, Version, Version)
	}
	if err := os.RemoveAll(dir); err != nil { // an incomplete install of an older run
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil {
		return "", fmt.Errorf("installing %s@%s: %w", Package, Version, err)
	}
	return dir, nil
}

// Require returns the directory Install installs into, installing the
// library if needed. Where node or npm is missing the test skips, except
// under CI=true, where it fails; a failed install fails the test.
func Require(tb testing.TB) string {
	tb.Helper()
	if err := Available(); err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("CI=true but %v", err)
		}
		tb.Skipf("skipping: %v", err)
	}
	dir, err := Install(tb.Context())
	if err != nil {
		tb.Fatal(err)
	}
	return dir
}

// Cache is what the library read from a cache (offline.cjs).
type Cache struct {
	// CacheDir is the cache the library used: its getHFHubCachePath(), from
	// $HF_HUB_CACHE.
	CacheDir string `json:"cacheDir"`
	// Repos is scanCacheDir()'s repositories.
	Repos []Repo `json:"repos"`
	// Warnings is scanCacheDir()'s warnings: the repositories it could not
	// read, each with why.
	Warnings []string `json:"warnings"`
	// Resolved is the revision asked for, found by repository name and ref;
	// nil when scanCacheDir lists no such repository or no revision that ref
	// names.
	Resolved *Resolved `json:"resolved"`
	// NetworkAttempts lists the URLs the library tried to fetch (each
	// failed): none, offline.
	NetworkAttempts []string `json:"networkAttempts"`
}

// Repo is one repository of scanCacheDir().
type Repo struct {
	Type      string     `json:"type"` // "model"
	Name      string     `json:"name"` // "org/name"
	Path      string     `json:"path"`
	Revisions []Revision `json:"revisions"`
}

// Revision is one snapshot of a repository, with the refs that name it.
type Revision struct {
	Commit string       `json:"commit"` // the snapshot directory's name
	Refs   []string     `json:"refs"`   // sorted
	Path   string       `json:"path"`
	Files  []CachedFile `json:"files"` // the snapshot's top level only
}

// CachedFile is a file of a snapshot and the blob it resolves to.
type CachedFile struct {
	Path string `json:"path"`
	Blob string `json:"blob"` // realpath of Path
	Size int64  `json:"size"` // the blob's
}

// Resolved is the revision asked for and the files read through it.
type Resolved struct {
	Commit   string         `json:"commit"`
	Snapshot string         `json:"snapshot"`
	Files    []ResolvedFile `json:"files"`
}

// ResolvedFile is a file read through the path downloadFileToCacheDir
// returned for it.
type ResolvedFile struct {
	Path    string `json:"path"`
	Pointer string `json:"pointer"`
	Content []byte `json:"content"` // base64 in JSON
}

// ReadCache reads the hub cache at cacheDir (what HF_HUB_CACHE names: the
// directory holding models--org--name) with the library installed in
// moduleDir, offline: it lists the cache with scanCacheDir, finds model
// repo by name and its revision by the ref named revision ("main"), and
// reads each of paths through downloadFileToCacheDir at that revision's
// commit. See offline.cjs for exactly what it calls.
func ReadCache(ctx context.Context, moduleDir, cacheDir, repo, revision string, paths ...string) (*Cache, error) {
	f, err := os.CreateTemp("", "weightd-offline-*.cjs")
	if err != nil {
		return nil, err
	}
	script := f.Name()
	defer os.Remove(script)
	_, err = f.Write(offlineScript)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, "node", append([]string{script, moduleDir, repo, revision}, paths...)...)
	cmd.Dir = cacheDir
	// HF_HUB_OFFLINE is set as a loader would have it, though this library
	// reads no such variable: offline.cjs makes every request fail instead.
	cmd.Env = append(os.Environ(), "HF_HUB_CACHE="+cacheDir, "HF_HUB_OFFLINE=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("node %s: %w\n%s", filepath.Base(script), err, stderr.Bytes())
	}
	var c Cache
	if err := json.Unmarshal(stdout.Bytes(), &c); err != nil {
		return nil, fmt.Errorf("node %s printed %q: %w", filepath.Base(script), stdout.Bytes(), err)
	}
	return &c, nil
}
