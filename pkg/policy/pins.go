package policy

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
)

// dirBlobs lists the blobs a materialised model directory links to: each
// file is a symlink into the store's blobs/sha256/<hex>. Entries that are
// not such links are skipped; a directory that is gone lists nothing.
func dirBlobs(dir string) ([]digest.Digest, error) {
	if dir == "" {
		return nil, nil
	}
	var out []digest.Digest
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type()&fs.ModeSymlink == 0 {
			return nil
		}
		target, err := os.Readlink(path)
		if err != nil {
			return err
		}
		if dg, ok := cache.LinkedBlob(target); ok {
			out = append(out, dg)
		}
		return nil
	})
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return out, err
}
