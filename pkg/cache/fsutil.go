package cache

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// WriteFileAtomic writes b to path so that a reader or a crash sees either the
// old content or the new, never a mix: temp file, fsync, rename, fsync dir.
// The cache writes its own small files this way; the registry mirror its
// state. A full disk is ErrDiskFull.
func WriteFileAtomic(path string, b []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return diskErr(err)
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Chmod(perm)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return diskErr(err)
	}
	return SyncDir(dir)
}

// SyncDir makes a rename or create in dir durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("syncing directory %s: %w", dir, err)
	}
	return nil
}

// allocate reserves size bytes of disk for f so that the download cannot run
// out of space halfway; filesystems without fallocate get a sparse file.
func allocate(f *os.File, size int64) error {
	if size == 0 {
		return nil
	}
	err := unix.Fallocate(int(f.Fd()), 0, 0, size)
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) {
		err = f.Truncate(size)
	}
	return diskErr(err)
}

// fdatasync flushes f's data (not its metadata timestamps).
func fdatasync(f *os.File) error {
	return diskErr(unix.Fdatasync(int(f.Fd())))
}

// diskErr turns "no space left on device" and "quota exceeded" into ErrDiskFull.
func diskErr(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return fmt.Errorf("%w: %w", ErrDiskFull, err)
	}
	return err
}

// fsSpace reports the size of the filesystem holding dir and the bytes free
// to an unprivileged user.
func fsSpace(dir string) (total, free int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return int64(st.Blocks) * st.Bsize, int64(st.Bavail) * st.Bsize, nil
}
