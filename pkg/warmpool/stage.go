package warmpool

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/weightd/weightd/pkg/cache"
)

// AdapterName derives the model name of the adapter at ref: the last element
// of its path, without tag, revision, query or fragment, reduced to the
// characters engine.ValidAdapterName allows, then "-" and 8 hex digits of the reference's
// sha256, so that two references never share a name by accident.
// "hf://org/sql-lora@main" becomes "sql-lora-1a2b3c4d".
func AdapterName(ref string) string {
	sum := sha256.Sum256([]byte(ref))
	suffix := hex.EncodeToString(sum[:4])
	s := ref
	if i := strings.Index(s, "://"); i >= 0 {
		s = s[i+3:]
	}
	if i := strings.IndexAny(s, "?#"); i >= 0 {
		s = s[:i]
	}
	if i := strings.Index(s, "@"); i >= 0 {
		s = s[:i]
	}
	s = strings.TrimRight(s, "/")
	s = s[strings.LastIndex(s, "/")+1:]
	if i := strings.Index(s, ":"); i >= 0 {
		s = s[:i]
	}
	s = strings.TrimSuffix(s, ".json")
	var b strings.Builder
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == '-':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	stem := strings.TrimLeft(b.String(), "._-")
	const maxStem = 64 - 1 - 8
	if len(stem) > maxStem {
		stem = stem[:maxStem]
	}
	if stem == "" {
		return "lora-" + suffix
	}
	return stem + "-" + suffix
}

// stageName is the directory under the stage directory that holds the
// adapter name with the files whose contentDigest is digest: a name with new
// weights is never staged where the old ones were, and a loaded adapter's
// path says which weights it holds.
func stageName(name, digest string) string { return name + "." + digest }

// stageDigestOf returns the digest in the stage directory name of the
// adapter name that a runtime loaded from path, or "" when path is not a
// stage directory of that name under serverStageDir.
func stageDigestOf(serverStageDir, name, path string) string {
	if filepath.Clean(filepath.Dir(path)) != filepath.Clean(serverStageDir) {
		return ""
	}
	digest, ok := strings.CutPrefix(filepath.Base(path), name+".")
	if !ok || len(digest) != digestLen || strings.Trim(digest, "0123456789abcdef") != "" {
		return ""
	}
	return digest
}

// digestLen is the length of a contentDigest: 128 bits in hex.
const digestLen = 32

// contentDigest names the adapter files under dir by content: the sha256 of
// each regular file's path and contents (symlinks followed, as stage does),
// in lexical order, cut to digestLen hex digits.
func contentDigest(dir string) (string, error) {
	h := sha256.New()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		sum, err := fileSum(p)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%q %x\n", rel, sum)
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("hashing adapter files in %s: %w", dir, err)
	}
	return hex.EncodeToString(h.Sum(nil))[:digestLen], nil
}

// fileSum is the sha256 of the file at p. A link into the cache's blobs is
// named by it: the cache checked the blob's bytes against that name when it
// committed it, so an adapter's weights are not read again on each load.
func fileSum(p string) ([]byte, error) {
	if target, err := os.Readlink(p); err == nil {
		if d, ok := cache.LinkedBlob(target); ok {
			return hex.DecodeString(d.Encoded())
		}
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return nil, err
	}
	return h.Sum(nil), nil
}

// stageTmpPrefix starts the names of directories being staged; a crash
// leaves them behind and New removes them.
const stageTmpPrefix = ".tmp-"

// stageDir lays out the adapter files of src under root/name: every regular
// file (symlinks, such as the cache's links into its blobs, are followed) is
// hard-linked there, or copied where a link cannot cross filesystems. The
// directory is built under a temporary name and renamed into place, so a
// server never sees a half-staged adapter; staging again replaces it
// atomically.
func stageDir(root, name, src string) error {
	tmp, err := os.MkdirTemp(root, stageTmpPrefix+name+"-")
	if err != nil {
		return fmt.Errorf("staging adapter %s: %w", name, err)
	}
	if err := linkTree(src, tmp); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("staging adapter %s from %s: %w", name, src, err)
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("staging adapter %s: %w", name, err)
	}
	final := filepath.Join(root, name)
	// Swap the new directory in; the old one (if any) ends up in tmp.
	err = unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, final, unix.RENAME_EXCHANGE)
	if errors.Is(err, unix.ENOENT) {
		err = os.Rename(tmp, final)
	}
	if err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("staging adapter %s: %w", name, err)
	}
	os.RemoveAll(tmp)
	return cache.SyncDir(root)
}

// linkTree recreates the regular files of src (following symlinks) under
// dst, which exists and is empty.
func linkTree(src, dst string) error {
	files := 0
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil || rel == "." {
			return err
		}
		if d.IsDir() {
			return os.Mkdir(filepath.Join(dst, rel), 0o755)
		}
		real, err := filepath.EvalSymlinks(p)
		if err != nil {
			return err
		}
		fi, err := os.Stat(real)
		if err != nil {
			return err
		}
		if fi.IsDir() {
			return fmt.Errorf("%s: a link to a directory", rel)
		}
		if !fi.Mode().IsRegular() {
			return fmt.Errorf("%s: not a regular file", rel)
		}
		files++
		return linkOrCopy(real, filepath.Join(dst, rel))
	})
	if err == nil && files == 0 {
		err = errors.New("no files")
	}
	return err
}

// linkOrCopy hard-links src at dst, or copies it when a link is not
// possible (another filesystem, a filesystem without links).
func linkOrCopy(src, dst string) error {
	err := os.Link(src, dst)
	if err == nil || !errors.Is(err, unix.EXDEV) && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EMLINK) {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}

// cleanStage removes what a crash left half-staged under root.
func cleanStage(root string) error {
	entries, err := os.ReadDir(root)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), stageTmpPrefix) {
			if err := os.RemoveAll(filepath.Join(root, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// stageOnce stages the adapter files of dir under StageDir/stage unless
// they are there already (stage names their content).
func (p *Pool) stageOnce(stage, dir string) error {
	p.stageMu.Lock()
	defer p.stageMu.Unlock()
	if _, err := os.Stat(filepath.Join(p.cfg.StageDir, stage)); err == nil {
		return nil
	}
	return stageDir(p.cfg.StageDir, stage, dir)
}

// unstage removes StageDir/stage when no server holds or loads an adapter
// from it.
func (p *Pool) unstage(stage string) {
	if stage == "" {
		return
	}
	p.stageMu.Lock()
	defer p.stageMu.Unlock()
	p.mu.Lock()
	for _, s := range p.servers {
		for _, a := range s.adapters {
			if a.stage == stage {
				p.mu.Unlock()
				return
			}
		}
	}
	p.mu.Unlock()
	if err := os.RemoveAll(filepath.Join(p.cfg.StageDir, stage)); err != nil {
		p.log.Warn("removing a staged adapter", "stage", stage, "err", err)
	}
}
