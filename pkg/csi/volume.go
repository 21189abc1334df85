package csi

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// ErrBrokenBlob means a blob the cache lists is missing or not the size it
// was verified at: someone changed the cache by hand.
var ErrBrokenBlob = errors.New("cached blob missing or altered")

// brokenBlobError names the blob found missing or altered; it is ErrBrokenBlob.
type brokenBlobError struct {
	digest digest.Digest
	detail string
}

func (e *brokenBlobError) Error() string {
	return fmt.Sprintf("blob %s: %v: %s", e.digest, ErrBrokenBlob, e.detail)
}

func (e *brokenBlobError) Is(target error) bool { return target == ErrBrokenBlob }

// record is what the agent keeps per published volume, to hold its blobs again
// and to clean up after a restart.
type record struct {
	VolumeID string `json:"volumeID"`
	Target   string `json:"target"`
	// Namespace and Pod are the asking pod's (empty in records written
	// before they were kept, and without podInfoOnMount).
	Namespace string          `json:"namespace,omitempty"`
	Pod       string          `json:"pod,omitempty"`
	Ref       string          `json:"ref"`
	Files     []string        `json:"files,omitempty"` // the globs asked for
	Blobs     []digest.Digest `json:"blobs"`
}

// volumeKey names a volume's tree and record. One volume id may be published
// at several targets (a persistent volume used by two pods of the node), and
// each gets its own tree, since rebuilding one would empty the other's mount.
// Ids and targets are the kubelet's, so they are hashed rather than trusted
// as file names.
func volumeKey(volumeID, target string) string {
	sum := sha256.Sum256([]byte(volumeID + "\x00" + target))
	return hex.EncodeToString(sum[:16])
}

// legacyKey is the key of a volume published when volumes were keyed by id
// alone; its record and tree keep that name until it is unpublished.
func legacyKey(volumeID string) string {
	sum := sha256.Sum256([]byte(volumeID))
	return hex.EncodeToString(sum[:16])
}

// modelFiles lists the files of the materialised snapshot dir (relative
// symlinks into the store's blobs) with their digests and verified sizes.
func modelFiles(store *cache.Store, dir string) ([]content.File, error) {
	var files []content.File
	err := filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		target, err := os.Readlink(p)
		if err != nil {
			return fmt.Errorf("snapshot entry %s: %w", rel, err)
		}
		d, ok := cache.LinkedBlob(target)
		if !ok {
			return fmt.Errorf("snapshot entry %s links to %s, not a blob", rel, target)
		}
		info, err := store.Stat(d)
		if err != nil {
			return fmt.Errorf("snapshot entry %s: %w", rel, err)
		}
		files = append(files, content.File{Path: filepath.ToSlash(rel), Descriptor: info.Descriptor})
		return nil
	})
	return files, err
}

// verifyBlob checks that the blob file is the regular file of the size the
// cache verified.
func verifyBlob(store *cache.Store, desc content.Descriptor) (string, error) {
	p, err := store.BlobPath(desc.Digest)
	if err != nil {
		return "", err
	}
	st, err := os.Lstat(p)
	if err != nil {
		return "", &brokenBlobError{desc.Digest, err.Error()}
	}
	if !st.Mode().IsRegular() || st.Size() != desc.Size {
		return "", &brokenBlobError{desc.Digest, fmt.Sprintf("%s of %d bytes, verified at %d", st.Mode().Type(), st.Size(), desc.Size)}
	}
	return p, nil
}

// layout is the tree a volume shows the pod.
type layout struct {
	Name, Revision, Ref string
	Files               []content.File
}

// build writes the volume's tree into dir (which must not exist) as hard
// links to the blobs, plus model.json and the hub cache layout.
func (l layout) build(store *cache.Store, dir string) error {
	snap := filepath.Join(dir, "hub", hubRepoDir(l.Name), "snapshots", l.Revision)
	for _, f := range l.Files {
		if err := content.ValidatePath(f.Path); err != nil {
			return err
		}
		blob, err := verifyBlob(store, f.Descriptor)
		if err != nil {
			return err
		}
		for _, base := range []string{dir, snap} {
			p := filepath.Join(base, filepath.FromSlash(f.Path))
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			if err := os.Link(blob, p); err != nil {
				return fmt.Errorf("linking %s: %w", f.Path, err)
			}
		}
	}
	if l.Ref != "" && l.Ref != l.Revision {
		refs := filepath.Join(dir, "hub", hubRepoDir(l.Name), "refs", filepath.FromSlash(l.Ref))
		if err := os.MkdirAll(filepath.Dir(refs), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(refs, []byte(l.Revision), 0o444); err != nil {
			return err
		}
	}
	m, err := json.MarshalIndent(content.Model{Name: l.Name, Revision: l.Revision, Ref: l.Ref, Files: l.Files}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "model.json"), m, 0o444)
}

// hubRepoDir is huggingface_hub's directory name for a model repository.
func hubRepoDir(name string) string {
	return "models--" + strings.ReplaceAll(name, "/", "--")
}
