package policy

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"

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

func (c *Controller) pinSet(name string) map[digest.Digest]bool {
	s := c.pinned[name]
	if s == nil {
		s = make(map[digest.Digest]bool)
		c.pinned[name] = s
	}
	return s
}

// pinAll pins the blobs for the policy that it does not pin yet.
func (c *Controller) pinAll(name string, blobs []digest.Digest) error {
	set := c.pinSet(name)
	for _, d := range blobs {
		if set[d] {
			continue
		}
		if err := c.pins.Pin(d, PinOwner(name)); err != nil {
			return fmt.Errorf("pinning %s for policy %s: %w", d, name, err)
		}
		set[d] = true
	}
	return nil
}

// unpinExcept drops the policy's pins on blobs not in keep.
func (c *Controller) unpinExcept(name string, keep map[digest.Digest]bool) error {
	set := c.pinned[name]
	for _, d := range slices.Sorted(maps.Keys(set)) {
		if keep[d] {
			continue
		}
		if err := c.pins.Unpin(d, PinOwner(name)); err != nil {
			return fmt.Errorf("unpinning %s for policy %s: %w", d, name, err)
		}
		delete(set, d)
	}
	if len(set) == 0 {
		delete(c.pinned, name)
	}
	return nil
}

func (c *Controller) unpinAll(name string) error { return c.unpinExcept(name, nil) }
