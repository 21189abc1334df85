package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/weightd/weightd/internal/benchnet"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/internal/testbed"
)

// node is one node of the testbed: its host and the containerd in it.
type node struct {
	host *testbed.Host
	ctd  *services.Containerd
}

// startNodes starts a containerd with an empty root in each node's host,
// all at once.
func (b *bench) startNodes(ctx context.Context, dir string) ([]*node, error) {
	nodes := make([]*node, len(b.hosts))
	errs := make([]error, len(b.hosts))
	var wg sync.WaitGroup
	for i, h := range b.hosts {
		wg.Go(func() {
			ctd, err := services.StartContainerd(ctx, services.ContainerdConfig{
				Dir: filepath.Join(dir, h.Name, "containerd"), Binaries: b.bins, Host: h,
			})
			if err != nil {
				errs[i] = fmt.Errorf("containerd in %s: %w", h.Name, err)
				return
			}
			nodes[i] = &node{host: h, ctd: ctd}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		closeNodes(nodes)
		return nil, err
	}
	return nodes, nil
}

// closeNodes stops every containerd, kills what it started and unmounts
// what it left mounted.
func closeNodes(nodes []*node) {
	for _, n := range nodes {
		if n != nil {
			if err := n.ctd.Close(); err != nil {
				log.Printf("closing the containerd in %s: %v", n.host.Name, err)
			}
		}
	}
}

// hostsFile is the node's hosts.toml for registry.
func (n *node) hostsFile(registry string) string {
	return filepath.Join(n.ctd.HostsDir, registry, "hosts.toml")
}

// writeRegistryHosts writes the hosts.toml of a node without a mirror: the
// registry alone, over plain HTTP (containerd would try HTTPS first
// otherwise, and the CRI has no --plain-http).
func (n *node) writeRegistryHosts(registry string) error {
	p := n.hostsFile(registry)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return os.WriteFile(p, fmt.Appendf(nil, "server = %q\n", "http://"+registry), 0o644)
}

// waitMirrorHosts waits until the node's agent has written its hosts.toml
// for registry (it does at start, beside its API coming up).
func (n *node) waitMirrorHosts(ctx context.Context, registry string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		b, err := os.ReadFile(n.hostsFile(registry))
		if err == nil && bytes.Contains(b, []byte("[host.")) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the agent in %s wrote no hosts.toml with its mirror in %v (%v)", n.host.Name, timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// pull pulls ref with client and returns how long it took.
func (n *node) pull(ctx context.Context, client, ref string) (time.Duration, error) {
	start := time.Now()
	switch client {
	case "cri":
		if _, err := n.ctd.PullImageCRI(ctx, ref); err != nil {
			return 0, n.failure(err)
		}
	default:
		cmd := n.ctd.CtrCommand(ctx, "content", "fetch", "--hosts-dir", n.ctd.HostsDir, "--plain-http", ref)
		var stderr tail
		cmd.Stdout = io.Discard // a progress table, ten times a second
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			return 0, n.failure(fmt.Errorf("ctr content fetch %s: %w: %s", ref, err, strings.TrimSpace(stderr.String())))
		}
	}
	return time.Since(start), nil
}

// verify checks that the node's containerd holds every blob of img (and,
// after a CRI pull, the image under its name).
func (n *node) verify(ctx context.Context, client string, img benchnet.Image) error {
	out, err := n.ctd.Ctr(ctx, "content", "ls", "-q")
	if err != nil {
		return n.failure(err)
	}
	have := make(map[string]bool)
	for _, d := range strings.Fields(string(out)) {
		have[d] = true
	}
	var missing []string
	for _, bl := range img.Blobs() {
		if !have[bl.Digest] {
			missing = append(missing, bl.Digest)
		}
	}
	if len(missing) > 0 {
		return n.failure(fmt.Errorf("after the pull, the content store lacks %s", strings.Join(missing, ", ")))
	}
	if client == "cri" {
		out, err := n.ctd.Ctr(ctx, "images", "ls", "-q")
		if err != nil {
			return n.failure(err)
		}
		if !strings.Contains("\n"+string(out), "\n"+img.Ref+"\n") {
			return n.failure(fmt.Errorf("after the CRI pull, containerd has no image %s", img.Ref))
		}
	}
	return nil
}

// contentBytes is what the node's content store holds, whole or being
// written: the sizes of its blobs and of its ingests' data.
func (n *node) contentBytes() int64 {
	root := filepath.Join(n.ctd.Root, "io.containerd.content.v1.content")
	var total int64
	for _, pattern := range []string{"blobs/*/*", "ingest/*/data"} {
		paths, _ := filepath.Glob(filepath.Join(root, pattern))
		for _, p := range paths {
			if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
				total += fi.Size()
			} else if err != nil && !errors.Is(err, fs.ErrNotExist) { // an ingest committed meanwhile is fine
				log.Printf("%s: %v", n.host.Name, err)
			}
		}
	}
	return total
}

// failure adds the end of the node's containerd log to err.
func (n *node) failure(err error) error {
	return fmt.Errorf("%s: %w\ncontainerd's log in %s ends:\n%s", n.host.Name, err, n.host.Name, n.ctd.LogTail())
}

// tail keeps the last 8 KiB written to it.
type tail struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > 8<<10 {
		t.buf = t.buf[len(t.buf)-8<<10:]
	}
	return len(p), nil
}

func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}
