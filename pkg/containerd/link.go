package containerd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"golang.org/x/sys/unix"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
)

// Linking a blob instead of writing it.
//
// containerd's content store keeps each committed blob as the read-only
// file blobs/sha256/<hex> under its root, and its metadata store, with the
// default "shared" content sharing policy, registers a blob whose file is
// there in a namespace that lacks it without any data: its Writer for that
// digest starts at the blob's full size and Commit only records it
// (metadata/content.go in containerd 1.6 and 2.x). weightd's cache keeps
// each verified blob the same way, read-only under blobs/sha256/<hex>,
// never written again. Where both are on one filesystem, a hard link makes
// the cache's file containerd's too: no bytes cross gRPC, containerd
// neither writes nor hashes them. The two names share one immutable inode;
// either side's eviction or garbage collection removes only its own name.
//
// containerd verifies what it is written, and trusts what is under blobs/.
// So that it never registers bytes that do not match their digest, a blob
// is hashed again, through the open file that is linked, before the link is
// made: a blob corrupted in the cache after it was verified fails the
// import (content.ErrDigestMismatch) rather than reaching containerd.

// contentPlugin is the type of containerd's content store plugin, which
// exports its root directory.
const contentPlugin = "io.containerd.content.v1"

// errLinkRefused marks a link that could not be made: the blob is written
// over gRPC instead.
var errLinkRefused = errors.New("hard link into containerd's content store refused")

// errNotShared is why linking stops when containerd wrote a linked blob
// rather than taking the file that was there: its content sharing policy
// is "isolated", or its content store is not where the link went.
var errNotShared = errors.New("containerd did not take the linked blob as shared content (content_sharing_policy isolated?)")

// detectContentRoot asks containerd where its content store is.
func detectContentRoot(ctx context.Context, c *containerd.Client) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := c.IntrospectionService().Plugins(ctx, `type==`+strconv.Quote(contentPlugin))
	if err != nil {
		return "", fmt.Errorf("asking containerd for its content store: %w", err)
	}
	for _, p := range resp.GetPlugins() {
		if root := p.GetExports()["root"]; root != "" && p.GetInitErr() == nil {
			return root, nil
		}
	}
	return "", errors.New("containerd names no content store root")
}

// linkBlob hard-links the cache blob b, open, into the content store whose
// root is root, once its bytes match its digest. It reports whether it made
// the link: false, nil when the content store has the file already. An
// error wrapping errLinkRefused means the blob is to be written instead; any
// other is the import's failure (the cache's blob is corrupt).
func linkBlob(root string, b *planBlob) (bool, error) {
	d := b.desc.Digest // validated by newPlan
	dir := filepath.Join(root, "blobs", d.Algorithm().String())
	dst := filepath.Join(dir, d.Encoded())
	if _, err := os.Lstat(dst); err == nil {
		// Only containerd, once it verified it, or a link made here once
		// verified puts a file there.
		return false, nil
	}
	// The ingest directory, which containerd's content store makes when it
	// starts, tells it from a directory that is not one.
	if fi, err := os.Stat(filepath.Join(root, "ingest")); err != nil || !fi.IsDir() {
		if err == nil {
			err = fmt.Errorf("%s is not a directory", filepath.Join(root, "ingest"))
		}
		return false, fmt.Errorf("%w: %s is not containerd's content store as seen from here: %w", errLinkRefused, root, err)
	}
	if _, err := os.Stat("/proc/self/fd"); err != nil {
		return false, fmt.Errorf("%w: links are made through /proc/self/fd: %w", errLinkRefused, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil { // as containerd makes it
		return false, fmt.Errorf("%w: %w", errLinkRefused, err)
	}
	if err := verifyBlob(b); err != nil {
		return false, err
	}
	if err := linkFile(b.file, dst); err != nil {
		if errors.Is(err, fs.ErrExist) { // put there meanwhile
			return false, nil
		}
		if errors.Is(err, syscall.ENOENT) {
			// Evicted from the cache since it was opened (a file without
			// a name cannot be linked): this blob only.
			return false, fmt.Errorf("%w: %v", errLinkRefused, err)
		}
		return false, fmt.Errorf("%w: %w", errLinkRefused, err)
	}
	// containerd may record the blob as soon as it is seen: the name must
	// outlive a crash, as containerd's own commits do.
	if err := cache.SyncDir(dir); err != nil {
		_ = os.Remove(dst)
		return false, fmt.Errorf("%w: %w", errLinkRefused, err)
	}
	return true, nil
}

// refusesAll reports whether a refused link says that no link into that
// content store will work (another filesystem, no permission, no such
// directory here), so that linking stops rather than failing blob by blob.
func refusesAll(err error) bool {
	for _, e := range []error{syscall.EXDEV, syscall.EPERM, syscall.EACCES, syscall.EROFS, syscall.ENOTDIR, syscall.ENOENT, syscall.ENOSPC, syscall.EMLINK, syscall.EOPNOTSUPP} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// verifyBlob hashes the open blob b and checks it against its digest.
func verifyBlob(b *planBlob) error {
	v := b.desc.Digest.Verifier()
	buf := make([]byte, 1<<20)
	n, err := io.CopyBuffer(v, io.NewSectionReader(b.file, 0, b.desc.Size), buf)
	if err != nil {
		return fmt.Errorf("reading blob %s in the cache: %w", b.desc.Digest, err)
	}
	if n != b.desc.Size || !v.Verified() {
		return fmt.Errorf("blob %s in the cache does not match its digest: %w", b.desc.Digest, content.ErrDigestMismatch)
	}
	return nil
}

// linkFile hard-links the open file f at dst. It links the file through its
// descriptor, so that the inode linked is the one that was opened and
// verified, whatever the cache did with its name meanwhile.
func linkFile(f *os.File, dst string) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var lerr error
	if err := rc.Control(func(fd uintptr) {
		src := "/proc/self/fd/" + strconv.FormatUint(uint64(fd), 10)
		lerr = unix.Linkat(unix.AT_FDCWD, src, unix.AT_FDCWD, dst, unix.AT_SYMLINK_FOLLOW)
	}); err != nil {
		return err
	}
	if lerr != nil {
		return &os.LinkError{Op: "link", Old: f.Name(), New: dst, Err: lerr}
	}
	return nil
}

// linkRoot is where blobs written through c are linked, or "" where they
// are not.
func (im *Importer) linkRoot(c *containerd.Client) string {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.client != c {
		return ""
	}
	return im.contentRoot
}

// stopLinking stops linking through c, for why: blobs are written over
// gRPC until the importer reconnects.
func (im *Importer) stopLinking(c *containerd.Client, why error) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.client != c || im.contentRoot == "" {
		return
	}
	im.log.Info("blobs cannot be hard-linked into containerd's content store; writing them over gRPC",
		"content_root", im.contentRoot, "error", why)
	im.contentRoot = ""
}

// resolveContentRoot sets where blobs are linked for the fresh client c.
// im.mu is held.
func (im *Importer) resolveContentRoot(ctx context.Context, c *containerd.Client) {
	switch im.cfg.ContentRoot {
	case ContentRootNone:
		im.contentRoot = ""
	case "":
		root, err := detectContentRoot(ctx, c)
		if err != nil {
			im.log.Info("writing blobs over gRPC: containerd's content store is unknown", "error", err)
		}
		im.contentRoot = root
	default:
		im.contentRoot = im.cfg.ContentRoot
	}
}
