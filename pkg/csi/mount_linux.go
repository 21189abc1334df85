package csi

import (
	"fmt"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// bindReadOnly bind-mounts src at target and makes that mount read-only: a
// bind ignores MS_RDONLY on creation, so it takes a remount.
func bindReadOnly(src, target string) error {
	if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mounting %s at %s: %w", src, target, err)
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV)
	if err := unix.Mount("", target, "", flags, ""); err != nil {
		_ = unix.Unmount(target, unix.MNT_DETACH)
		return fmt.Errorf("remounting %s read-only: %w", target, err)
	}
	return nil
}

func unmount(target string) error {
	if err := unix.Unmount(target, 0); err != nil {
		return fmt.Errorf("unmounting %s: %w", target, err)
	}
	return nil
}

func isMount(p string) (bool, error) { return mountinfo.Mounted(p) }
