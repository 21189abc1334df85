package podcgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"sync"
	"syscall"
)

// ErrUnknownCgroup is returned for a cgroup ID that no directory under the
// resolver's root has.
var ErrUnknownCgroup = errors.New("unknown cgroup id")

// Bounds of one walk of the cgroup tree, and of the remembered misses.
const (
	// MaxWalkDirs is the most directories one walk visits.
	MaxWalkDirs = 1 << 16
	// MaxWalkDepth is the deepest directory, below the root, a walk visits
	// (a container's scope is 4 or 5 levels down, a nested kubelet's 7).
	MaxWalkDepth = 12
	// maxMisses is how many unknown IDs are remembered before the set is
	// cleared.
	maxMisses = 4096
)

// Resolver maps cgroup v2 IDs, as bpf_get_current_cgroup_id() returns them,
// to pods. A cgroup v2 ID is the inode number of the cgroup's directory in
// the cgroup filesystem, so the resolver walks that tree once, remembers each
// directory's inode, and walks it again when asked for an ID it has not seen
// (a cgroup made since). An ID still unknown after a fresh walk is
// remembered as such, so a stream of events from cgroups outside the tree
// costs one walk, not one each. Safe for concurrent use.
type Resolver struct {
	root string

	mu     sync.Mutex
	byID   map[uint64]string // inode -> path relative to root
	misses map[uint64]struct{}
}

// NewResolver returns a Resolver for the cgroup v2 tree mounted at
// cgroupRoot (usually /sys/fs/cgroup). It reads nothing until asked.
func NewResolver(cgroupRoot string) *Resolver {
	return &Resolver{root: cgroupRoot, misses: make(map[uint64]struct{})}
}

// FromCgroupID returns the pod of the cgroup whose ID is id: ErrNotPod
// for a cgroup that is not a pod's (a system service, the root),
// ErrUnknownCgroup for an ID no directory has.
func (r *Resolver) FromCgroupID(id uint64) (Pod, error) {
	path, err := r.path(id)
	if err != nil {
		return Pod{}, err
	}
	return Parse(path)
}

// path returns the path, relative to the root, of cgroup id.
func (r *Resolver) path(id uint64) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p, ok := r.byID[id]; ok {
		return p, nil
	}
	if _, ok := r.misses[id]; ok && r.byID != nil {
		return "", fmt.Errorf("cgroup %d: %w", id, ErrUnknownCgroup)
	}
	byID, err := walk(r.root)
	if err != nil {
		return "", err
	}
	r.byID = byID
	if p, ok := byID[id]; ok {
		return p, nil
	}
	if len(r.misses) >= maxMisses {
		clear(r.misses)
	}
	r.misses[id] = struct{}{}
	return "", fmt.Errorf("cgroup %d: %w", id, ErrUnknownCgroup)
}

// errWalkFull stops a walk at MaxWalkDirs.
var errWalkFull = errors.New("walk full")

// walk maps the inode of each directory under root, at most MaxWalkDirs of
// them and MaxWalkDepth deep, to its path relative to root ("/" for root,
// "/kubepods.slice" below it, as /proc/<pid>/cgroup writes them).
func walk(root string) (map[uint64]string, error) {
	byID := make(map[uint64]string)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == root {
				return err
			}
			return nil // a cgroup removed mid-walk, or one we may not read
		}
		if !d.IsDir() {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = "/" + filepath.ToSlash(rel)
		if rel == "/." {
			rel = "/"
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return fmt.Errorf("stat of %s carries no inode", p)
		}
		byID[st.Ino] = rel
		if len(byID) >= MaxWalkDirs {
			return errWalkFull
		}
		if depth(rel) >= MaxWalkDepth {
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil && !errors.Is(err, errWalkFull) {
		return nil, fmt.Errorf("walking cgroups under %s: %w", root, err)
	}
	return byID, nil
}

// depth is how many directories below the root rel is.
func depth(rel string) int {
	n := 0
	for i := range len(rel) {
		if rel[i] == '/' {
			n++
		}
	}
	if rel == "/" {
		return 0
	}
	return n
}
