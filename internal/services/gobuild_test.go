package services

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestGoInstallBuiltAlready: programs in place are kept, and the go command
// is not run (it is not on PATH).
func TestGoInstallBuiltAlready(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tool-1.0.0")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"a", "b"} {
		if err := os.WriteFile(filepath.Join(dir, b), []byte("#!/bin/true\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", "")
	g := goInstall{What: "tool", Dir: dir, Pkgs: []string{"example.com/a@v1.0.0", "example.com/b@v1.0.0"}, Bins: []string{"a", "b"}}
	if !g.built() {
		t.Fatal("not built, with both programs in place")
	}
	if err := g.run(t.Context()); err != nil {
		t.Fatal(err)
	}
	// A program that is not executable is not built.
	if err := os.Chmod(filepath.Join(dir, "b"), 0o644); err != nil {
		t.Fatal(err)
	}
	if g.built() {
		t.Error("built, with b not executable")
	}
}

// TestGoInstallFails: a failed build returns the go command's output and
// leaves no program and no temporary directory behind.
func TestGoInstallFails(t *testing.T) {
	parent := t.TempDir()
	t.Setenv("GOPROXY", "off")
	g := goInstall{What: "nothing v0.0.1", Dir: filepath.Join(parent, "nothing-0.0.1"), Pkgs: []string{"example.invalid/nothing@v0.0.1"}, Bins: []string{"nothing"}}
	err := g.run(t.Context())
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{"building nothing v0.0.1 (go install)", "example.invalid/nothing"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q lacks %q", err, want)
		}
	}
	if g.built() {
		t.Error("built after a failed build")
	}
	entries, err := os.ReadDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.Contains(e.Name(), "-build-") {
			t.Errorf("temporary directory %s left behind", e.Name())
		}
	}
}

// TestToolCacheDir: the variable names the base, else ~/.cache/weightd.
func TestToolCacheDir(t *testing.T) {
	t.Setenv("WEIGHTD_HELM_CACHE", "/x/y")
	if d, err := HelmCacheDir(); err != nil || d != "/x/y/helm-"+strings.TrimPrefix(HelmVersion, "v") {
		t.Errorf("HelmCacheDir() = %q, %v", d, err)
	}
	t.Setenv("WEIGHTD_CONTAINERD_CACHE", "")
	t.Setenv("HOME", "/home/u")
	if d, err := ContainerdCacheDir("v2.4.2"); err != nil || d != "/home/u/.cache/weightd/containerd-2.4.2" {
		t.Errorf("ContainerdCacheDir() = %q, %v", d, err)
	}
	t.Setenv("WEIGHTD_PROMTOOL_CACHE", "")
	if d, err := PromtoolCacheDir(); err != nil || d != "/home/u/.cache/weightd/promtool-"+strings.TrimPrefix(PromtoolVersion, "v") {
		t.Errorf("PromtoolCacheDir() = %q, %v", d, err)
	}
}
