// Package testdisk gives tests a small disk: a tmpfs of a chosen size,
// mounted for the test and unmounted at its end, so that disk-full and
// free-space behaviour is tested on a real filesystem; and ShortDir, a
// directory short enough for unix sockets.
package testdisk

import (
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// Tmpfs mounts a tmpfs of size bytes in a temporary directory and returns
// it. Mounting needs root: without it the test skips, except under CI=true
// (CI runs as root), where it fails.
func Tmpfs(tb testing.TB, size int64) string {
	tb.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			tb.Fatal("this test needs root (it mounts a small tmpfs); CI runs as root")
		}
		tb.Skip("needs root to mount a small tmpfs")
	}
	dir := tb.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0755", size)); err != nil {
		tb.Fatalf("mounting a tmpfs of %d bytes: %v", size, err)
	}
	tb.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// ShortDir returns a temporary directory with a short path, removed when
// the test ends: unix socket paths are limited to about 100 bytes, and
// t.TempDir can be longer.
func ShortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "wd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
