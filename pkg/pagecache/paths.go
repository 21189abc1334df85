package pagecache

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// resolve resolves the paths given to Keep into files.
func resolve(paths []string) []want {
	var ws []want
	for _, p := range paths {
		st, err := os.Stat(p)
		if err != nil || !st.IsDir() {
			ws = append(ws, resolveFile(p))
			continue
		}
		err = filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
			switch {
			case err != nil:
				ws = append(ws, want{path: q, err: fmt.Errorf("listing %s: %w", q, err)})
			case d.Type().IsRegular() || d.Type()&fs.ModeSymlink != 0:
				if w := resolveFile(q); !errors.Is(w.err, errNotRegular) {
					ws = append(ws, w)
				}
			}
			return nil
		})
		if err != nil {
			ws = append(ws, want{path: p, err: fmt.Errorf("listing %s: %w", p, err)})
		}
	}
	return ws
}

// errNotRegular marks a path that is not a regular file: an error when it
// is given to Keep, skipped when it is found under a given directory.
var errNotRegular = fmt.Errorf("%w: not a regular file", ErrInvalid)

// resolveFile follows p's symlinks to a regular file.
func resolveFile(p string) want {
	w := want{path: p}
	abs, err := filepath.Abs(p)
	if err == nil {
		w.resolved, err = filepath.EvalSymlinks(abs)
	}
	if err != nil {
		w.err = fmt.Errorf("resolving %s: %w", p, err)
		return w
	}
	st, err := os.Stat(w.resolved)
	switch {
	case err != nil:
		w.err = fmt.Errorf("resolving %s: %w", p, err)
	case !st.Mode().IsRegular():
		w.err = fmt.Errorf("%s: %w", p, errNotRegular)
	default:
		w.id, w.size = idOf(st), st.Size()
	}
	return w
}

// idOf is the device and inode of st.
func idOf(st fs.FileInfo) fileID {
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return fileID{}
	}
	return fileID{dev: uint64(sys.Dev), ino: sys.Ino} //nolint:unconvert // Dev is not uint64 on every architecture
}
