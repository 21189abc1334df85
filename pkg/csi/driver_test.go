package csi_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
)

// requireRoot skips a test that bind-mounts when not root, except under
// CI=true, where a test machine without root is broken.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("CI=true but bind mounts need root")
	}
	t.Skip("skipping: bind mounts need root")
}

// node is one agent's CSI side: a real cache and fetch queue against an
// in-process hub, served on a unix socket and driven by a gRPC client.
type node struct {
	t        *testing.T
	hub      *hubtest.Hub
	store    *cache.Store
	queue    *prefetch.Queue
	driver   *csi.Driver
	node     csipb.NodeClient
	identity csipb.IdentityClient
	reg      registerapi.RegistrationClient
	root     string
	stop     func()
}

type nodeOpts struct {
	allow      csi.Allowlist
	budget     int64
	targetRoot string
	announce   func(context.Context, csi.Published)
}

func newNode(t *testing.T, hub *hubtest.Hub, root string, o nodeOpts) *node {
	t.Helper()
	var copts []cache.Option
	if o.budget > 0 {
		copts = append(copts, cache.WithBudget(o.budget, 0))
	}
	store, err := cache.Open(filepath.Join(root, "cache"), copts...)
	require.NoError(t, err)
	src, err := hf.New(nil, hf.WithEndpoint(hub.URL), hf.WithVersion("test"))
	require.NoError(t, err)
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHF: src}, prefetch.WithResolveRetries(1, time.Millisecond))
	driver, err := csi.NewDriver(store, queue, csi.Config{
		NodeID: "node-a", StateDir: filepath.Join(root, "csi"), Allow: o.allow, TargetRoot: o.targetRoot, PublishWait: 10 * time.Second,
		Announce: o.announce,
	})
	require.NoError(t, err)
	require.NoError(t, driver.Reconcile())
	sock := filepath.Join(root, "plugins", "csi.sock")
	srv, err := csi.NewServer(driver, "unix://"+sock, filepath.Join(root, "registry"))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 2)
	go func() { done <- queue.Run(ctx) }()
	go func() { done <- srv.Run(ctx) }()
	conn := dial(t, sock)
	regConn := dial(t, filepath.Join(root, "registry", csi.RegistrationSocketName))
	n := &node{t: t, hub: hub, store: store, queue: queue, driver: driver, root: root,
		node: csipb.NewNodeClient(conn), identity: csipb.NewIdentityClient(conn), reg: registerapi.NewRegistrationClient(regConn)}
	var stopped bool
	n.stop = func() {
		if stopped {
			return
		}
		stopped = true
		conn.Close()
		regConn.Close()
		cancel()
		for range 2 {
			assert.NoError(t, <-done)
		}
		assert.NoError(t, store.Close())
	}
	t.Cleanup(n.stop)
	return n
}

func dial(t *testing.T, sock string) *grpc.ClientConn {
	t.Helper()
	require.Eventually(t, func() bool { _, err := os.Stat(sock); return err == nil }, 10*time.Second, 10*time.Millisecond)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}))
	require.NoError(t, err)
	return conn
}

func volumeCapability() *csipb.VolumeCapability {
	return &csipb.VolumeCapability{
		AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}},
		AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY},
	}
}

func (n *node) publish(id, target string, attrs map[string]string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	full := map[string]string{
		csi.AttrPodName: "pod-" + id, csi.AttrPodNamespace: "team-a", csi.AttrPodUID: "uid-" + id, csi.AttrEphemeral: "true",
	}
	for k, v := range attrs {
		full[k] = v
	}
	_, err := n.node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{
		VolumeId: id, TargetPath: target, VolumeCapability: volumeCapability(), Readonly: true, VolumeContext: full,
	})
	return err
}

// publishReady publishes, retrying Unavailable as the kubelet does.
func (n *node) publishReady(id, target string, attrs map[string]string) {
	n.t.Helper()
	var err error
	for range 20 {
		if err = n.publish(id, target, attrs); status.Code(err) != codes.Unavailable {
			break
		}
	}
	require.NoError(n.t, err)
}

func (n *node) unpublish(id, target string) {
	n.t.Helper()
	_, err := n.node.NodeUnpublishVolume(context.Background(), &csipb.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	require.NoError(n.t, err)
}

func modelRepo(hub *hubtest.Hub) (commit string, files map[string]hubtest.Content) {
	files = map[string]hubtest.Content{
		"config.json":              hubtest.String(`{"model_type":"llama"}`),
		"tokenizer.json":           hubtest.String(`{"version":"1.0"}`),
		"model-00001.safetensors":  hubtest.Generated(1<<20, 1),
		"model-00002.safetensors":  hubtest.Generated(1<<20, 2),
		"nested/extra/weights.bin": hubtest.Generated(4096, 3),
	}
	repo := hub.AddRepo("org/model", files)
	return repo.Resolve("main"), files
}

func mounted(t *testing.T, p string) bool {
	t.Helper()
	m, err := mountinfo.Mounted(p)
	if errors.Is(err, os.ErrNotExist) {
		return false
	}
	require.NoError(t, err)
	return m
}

// TestPublishModelVolume publishes a model as a pod would mount it: each file
// under its own name is the cache's blob inode (nothing copied), the hub
// cache layout and model.json are there, the mount is read-only, a repeated
// publish is a no-op, and unpublish unmounts and unpins.
func TestPublishModelVolume(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	commit, files := modelRepo(hub)
	n := newNode(t, hub, t.TempDir(), nodeOpts{})
	target := filepath.Join(n.root, "pods", "uid-1", "volumes", "model", "mount")
	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model@main"})
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })

	require.True(t, mounted(t, target))
	var m content.Model
	b, err := os.ReadFile(filepath.Join(target, "model.json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &m))
	assert.Equal(t, "org/model", m.Name)
	assert.Equal(t, commit, m.Revision)
	assert.Equal(t, "main", m.Ref)
	require.Len(t, m.Files, len(files))
	for _, f := range m.Files {
		c := files[f.Path]
		want := make([]byte, c.Size())
		_, err := c.ReadAt(want, 0)
		require.NoError(t, err)
		for _, p := range []string{
			filepath.Join(target, f.Path),
			filepath.Join(target, "hub", "models--org--model", "snapshots", commit, f.Path),
		} {
			got, err := os.ReadFile(p)
			require.NoError(t, err, p)
			assert.Equal(t, want, got, p)
			blob, err := n.store.BlobPath(f.Digest)
			require.NoError(t, err)
			assert.True(t, sameInode(t, blob, p), "%s is the blob's own inode", p)
		}
	}
	ref, err := os.ReadFile(filepath.Join(target, "hub", "models--org--model", "refs", "main"))
	require.NoError(t, err)
	assert.Equal(t, commit, string(ref))

	err = os.WriteFile(filepath.Join(target, "new"), nil, 0o644)
	assert.ErrorIs(t, err, syscall.EROFS)
	err = os.WriteFile(filepath.Join(target, "config.json"), []byte("x"), 0o644)
	assert.Error(t, err, "a blob is not writable through the volume")

	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model@main"})
	assert.Equal(t, 1, mountsAt(t, target), "a repeated publish mounts nothing more")

	n.unpublish("vol-1", target)
	assert.NoDirExists(t, target)
	n.unpublish("vol-1", target)
}

func sameInode(t *testing.T, a, b string) bool {
	t.Helper()
	var sa, sb unix.Stat_t
	require.NoError(t, unix.Stat(a, &sa))
	require.NoError(t, unix.Stat(b, &sb))
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

func mountsAt(t *testing.T, p string) int {
	t.Helper()
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p))
	require.NoError(t, err)
	return len(ms)
}

// TestPublishFilesSubset links only the files the globs name.
func TestPublishFilesSubset(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	modelRepo(hub)
	n := newNode(t, hub, t.TempDir(), nodeOpts{})
	target := filepath.Join(n.root, "target")
	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model", csi.AttrFiles: "*.json, nested/*/weights.bin"})
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	var got []string
	require.NoError(t, filepath.WalkDir(target, func(p string, e os.DirEntry, err error) error {
		if err == nil && !e.IsDir() && !strings.Contains(p, "/hub/") {
			rel, _ := filepath.Rel(target, p)
			got = append(got, rel)
		}
		return err
	}))
	assert.ElementsMatch(t, []string{"config.json", "tokenizer.json", "model.json", "nested/extra/weights.bin"}, got)

	err := n.publish("vol-2", filepath.Join(n.root, "t2"), map[string]string{csi.AttrModel: "hf://org/model", csi.AttrFiles: "*.gguf"})
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.ErrorContains(t, err, "matches none")
}

// TestPublishBadRequests fails clearly and at once, never hangs.
func TestPublishBadRequests(t *testing.T) {
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	modelRepo(hub)
	allow, err := csi.ParseAllowlist("team-a=hf://org/allowed")
	require.NoError(t, err)
	root := t.TempDir()
	n := newNode(t, hub, root, nodeOpts{allow: allow, targetRoot: filepath.Join(root, "kubelet")})
	target := filepath.Join(n.root, "kubelet", "target")
	for _, tc := range []struct {
		attrs map[string]string
		code  codes.Code
		msg   string
	}{
		{map[string]string{}, codes.InvalidArgument, `attribute "model" is required`},
		{map[string]string{csi.AttrModel: "ftp://x/y"}, codes.InvalidArgument, "model:"},
		{map[string]string{csi.AttrModel: "hf://org/allowed", "modle": "x"}, codes.InvalidArgument, `unknown attribute "modle"`},
		{map[string]string{csi.AttrModel: "hf://org/allowed", csi.AttrPriority: "urgent"}, codes.InvalidArgument, "priority"},
		{map[string]string{csi.AttrModel: "hf://org/allowed", csi.AttrFiles: "[a"}, codes.InvalidArgument, "pattern"},
		{map[string]string{csi.AttrModel: "hf://org/model"}, codes.PermissionDenied, `namespace "team-a" may not mount hf://org/model@main`},
	} {
		err := n.publish("vol", target, tc.attrs)
		assert.Equal(t, tc.code, status.Code(err), "%v: %v", tc.attrs, err)
		assert.ErrorContains(t, err, tc.msg)
	}
	for _, outside := range []string{filepath.Join(root, "etc"), filepath.Join(root, "kubelet", "..", "etc"), filepath.Join(root, "kubelet")} {
		err := n.publish("vol", outside, map[string]string{csi.AttrModel: "hf://org/allowed"})
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", outside, err)
		assert.ErrorContains(t, err, "is not under the kubelet's directory")
	}
	assert.NoDirExists(t, target)
}

// evictsModel reports whether fetching org/other (2 MiB, beside org/model's
// 2.1 MiB under a 3 MiB budget) may evict org/model: it may not while a
// volume holds it.
func (n *node) evictsModel() bool {
	n.t.Helper()
	target := filepath.Join(n.root, "other")
	var err error
	for range 20 {
		if err = n.publish("vol-other", target, map[string]string{csi.AttrModel: "hf://org/other"}); status.Code(err) != codes.Unavailable {
			break
		}
	}
	if status.Code(err) == codes.ResourceExhausted {
		return false
	}
	require.NoError(n.t, err)
	n.unpublish("vol-other", target)
	return true
}

// publishedUnderBudget starts a node whose budget (3 MiB) fits org/model or
// org/other but not both, and publishes org/model as vol-1 at root/target.
func publishedUnderBudget(t *testing.T) (n *node, hub *hubtest.Hub, root string, opts nodeOpts, target string) {
	t.Helper()
	requireRoot(t)
	hub = hubtest.New()
	t.Cleanup(hub.Close)
	modelRepo(hub)
	hub.AddRepo("org/other", map[string]hubtest.Content{"w.bin": hubtest.Generated(2<<20, 11)})
	root = t.TempDir()
	opts = nodeOpts{budget: 3 << 20}
	n = newNode(t, hub, root, opts)
	target = filepath.Join(root, "target")
	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model"})
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	return n, hub, root, opts, target
}

// TestAgentRestartKeepsPublishedVolume restarts the agent while a volume is
// mounted: the mount stays and its blobs are still held against eviction;
// once the mount is gone behind the agent's back, the next start releases
// them.
func TestAgentRestartKeepsPublishedVolume(t *testing.T) {
	n, hub, root, opts, target := publishedUnderBudget(t)
	assert.False(t, n.evictsModel(), "a published volume holds its blobs")
	n.stop()

	n = newNode(t, hub, root, opts)
	assert.True(t, mounted(t, target))
	_, err := os.ReadFile(filepath.Join(target, "config.json"))
	require.NoError(t, err)
	assert.False(t, n.evictsModel(), "the hold comes back after a restart")
	n.stop()

	require.NoError(t, unix.Unmount(target, 0))
	n = newNode(t, hub, root, opts)
	assert.True(t, n.evictsModel(), "a volume no longer mounted holds nothing")
	entries, err := os.ReadDir(filepath.Join(root, "csi"))
	require.NoError(t, err)
	assert.Empty(t, entries, "the record of a volume no longer mounted is dropped")
}

// TestPublishDetectsBlobChangedByHand removes and truncates blobs under the
// cache: the publish fails naming the blob, and no tree is mounted; the
// blob is fetched again and the kubelet's next try mounts the model.
func TestPublishDetectsBlobChangedByHand(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	modelRepo(hub)
	n := newNode(t, hub, t.TempDir(), nodeOpts{})
	first := filepath.Join(n.root, "first")
	n.publishReady("vol-1", first, map[string]string{csi.AttrModel: "hf://org/model"})
	t.Cleanup(func() { _ = unix.Unmount(first, unix.MNT_DETACH) })
	var m content.Model
	b, err := os.ReadFile(filepath.Join(first, "model.json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &m))
	for i, change := range []func(string) error{
		os.Remove,
		func(p string) error { return os.Truncate(p, 1) },
	} {
		blob, err := n.store.BlobPath(m.Files[i].Digest)
		require.NoError(t, err)
		require.NoError(t, os.Chmod(blob, 0o644))
		require.NoError(t, change(blob))
		target := filepath.Join(n.root, fmt.Sprint("t", i))
		err = n.publish(fmt.Sprint("vol-t", i), target, map[string]string{csi.AttrModel: "hf://org/model"})
		assert.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
		assert.ErrorContains(t, err, "cached blob missing or altered")
		assert.False(t, mounted(t, target) && fileExists(target, "model.json"), "no tree is mounted")
		n.publishReady(fmt.Sprint("vol-t", i), target, map[string]string{csi.AttrModel: "hf://org/model"})
		t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
		for _, f := range m.Files {
			got, err := os.ReadFile(filepath.Join(target, filepath.FromSlash(f.Path)))
			require.NoError(t, err)
			require.Equal(t, f.Digest, digest.FromBytes(got), "%s fetched again", f.Path)
		}
	}
}

func fileExists(dir, name string) bool {
	_, err := os.Stat(filepath.Join(dir, name))
	return err == nil
}

// TestHundredPublishesOneDownload mounts one model for 100 pods at once.
func TestHundredPublishesOneDownload(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	_, files := modelRepo(hub)
	var size int64
	for _, c := range files {
		size += c.Size()
	}
	n := newNode(t, hub, t.TempDir(), nodeOpts{})
	const pods = 100
	errs := make(chan error, pods)
	targets := make([]string, pods)
	for i := range pods {
		targets[i] = filepath.Join(n.root, "pods", fmt.Sprint(i))
		t.Cleanup(func() { _ = unix.Unmount(targets[i], unix.MNT_DETACH) })
		go func() {
			var err error
			for range 20 {
				if err = n.publish(fmt.Sprint("vol-", i), targets[i], map[string]string{csi.AttrModel: "hf://org/model"}); status.Code(err) != codes.Unavailable {
					break
				}
			}
			errs <- err
		}()
	}
	for range pods {
		require.NoError(t, <-errs)
	}
	for _, target := range targets {
		assert.True(t, fileExists(target, "config.json"), target)
	}
	assert.Equal(t, size, hub.Stats().Bytes, "every file downloaded once")
}

// TestModelLargerThanBudget refuses clearly and evicts nothing.
func TestModelLargerThanBudget(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	hub.AddRepo("org/small", map[string]hubtest.Content{"w.bin": hubtest.Generated(64<<10, 9)})
	hub.AddRepo("org/huge", map[string]hubtest.Content{"w.bin": hubtest.Generated(4<<20, 10)})
	n := newNode(t, hub, t.TempDir(), nodeOpts{budget: 1 << 20})
	small := filepath.Join(n.root, "small")
	n.publishReady("vol-small", small, map[string]string{csi.AttrModel: "hf://org/small"})
	t.Cleanup(func() { _ = unix.Unmount(small, unix.MNT_DETACH) })
	before := n.store.List()

	err := n.publish("vol-huge", filepath.Join(n.root, "huge"), map[string]string{csi.AttrModel: "hf://org/huge"})
	assert.Equal(t, codes.ResourceExhausted, status.Code(err), "%v", err)
	assert.ErrorContains(t, err, "does not fit")
	assert.Len(t, n.store.List(), len(before), "nothing evicted")
	assert.True(t, fileExists(small, "w.bin"))
}

// TestIdentityAndRegistration answers what the kubelet asks first.
func TestIdentityAndRegistration(t *testing.T) {
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	n := newNode(t, hub, t.TempDir(), nodeOpts{})
	ctx := context.Background()
	info, err := n.identity.GetPluginInfo(ctx, &csipb.GetPluginInfoRequest{})
	require.NoError(t, err)
	assert.Equal(t, "models.weightd.io", info.GetName())
	_, err = n.identity.Probe(ctx, &csipb.ProbeRequest{})
	require.NoError(t, err)
	ni, err := n.node.NodeGetInfo(ctx, &csipb.NodeGetInfoRequest{})
	require.NoError(t, err)
	assert.Equal(t, "node-a", ni.GetNodeId())

	reg, err := n.reg.GetInfo(ctx, &registerapi.InfoRequest{})
	require.NoError(t, err)
	assert.Equal(t, registerapi.CSIPlugin, reg.GetType())
	assert.Equal(t, "models.weightd.io", reg.GetName())
	assert.Equal(t, filepath.Join(n.root, "plugins", "csi.sock"), reg.GetEndpoint())
	assert.Contains(t, reg.GetSupportedVersions(), "1.0.0")
	_, err = n.reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true})
	require.NoError(t, err)
}

// TestPersistentVolumeTwoPods publishes one volume id at two targets, as the
// kubelet does for a persistent volume that two pods of the node use: each
// gets its own tree, and unpublishing one leaves the other whole and held.
func TestPersistentVolumeTwoPods(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	modelRepo(hub)
	hub.AddRepo("org/other", map[string]hubtest.Content{"w.bin": hubtest.Generated(2<<20, 11)})
	n := newNode(t, hub, t.TempDir(), nodeOpts{budget: 3 << 20})
	attrs := map[string]string{csi.AttrModel: "hf://org/model@main", csi.AttrEphemeral: "false"}
	a, b := filepath.Join(n.root, "pod-a", "mount"), filepath.Join(n.root, "pod-b", "mount")
	n.publishReady("pv-model", a, attrs)
	t.Cleanup(func() { _ = unix.Unmount(a, unix.MNT_DETACH) })
	n.publishReady("pv-model", b, attrs)
	t.Cleanup(func() { _ = unix.Unmount(b, unix.MNT_DETACH) })
	assert.True(t, fileExists(a, "config.json"))
	assert.True(t, fileExists(b, "config.json"))

	n.unpublish("pv-model", a)
	assert.False(t, mounted(t, a))
	got, err := os.ReadFile(filepath.Join(b, "config.json"))
	require.NoError(t, err)
	assert.JSONEq(t, `{"model_type":"llama"}`, string(got), "the other pod's tree is whole")
	assert.False(t, n.evictsModel(), "the other pod's volume still holds the model")
	n.unpublish("pv-model", b)
	assert.True(t, n.evictsModel())
}

// TestPublishIncompatibleAgain refuses a volume id published at a target
// with other attributes: CSI's ALREADY_EXISTS, and the mount is untouched.
func TestPublishIncompatibleAgain(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	modelRepo(hub)
	n := newNode(t, hub, t.TempDir(), nodeOpts{})
	target := filepath.Join(n.root, "target")
	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model"})
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	for _, attrs := range []map[string]string{
		{csi.AttrModel: "hf://org/model", csi.AttrFiles: "*.json"},
		{csi.AttrModel: "hf://org/model@v2"},
	} {
		err := n.publish("vol-1", target, attrs)
		assert.Equal(t, codes.AlreadyExists, status.Code(err), "%v: %v", attrs, err)
	}
	assert.True(t, fileExists(target, "model-00001.safetensors"), "the mounted tree is untouched")
}

// TestVolumeStats reports a volume's bytes and files as the model's.
func TestVolumeStats(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	_, files := modelRepo(hub)
	var size int64
	for _, c := range files {
		size += c.Size()
	}
	n := newNode(t, hub, t.TempDir(), nodeOpts{})
	ctx := context.Background()
	caps, err := n.node.NodeGetCapabilities(ctx, &csipb.NodeGetCapabilitiesRequest{})
	require.NoError(t, err)
	require.Len(t, caps.GetCapabilities(), 1)
	assert.Equal(t, csipb.NodeServiceCapability_RPC_GET_VOLUME_STATS, caps.GetCapabilities()[0].GetRpc().GetType())

	target := filepath.Join(n.root, "target")
	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model"})
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	st, err := n.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: "vol-1", VolumePath: target})
	require.NoError(t, err)
	usage := map[csipb.VolumeUsage_Unit]*csipb.VolumeUsage{}
	for _, u := range st.GetUsage() {
		usage[u.GetUnit()] = u
	}
	assert.Equal(t, size, usage[csipb.VolumeUsage_BYTES].GetUsed())
	assert.Equal(t, size, usage[csipb.VolumeUsage_BYTES].GetTotal())
	assert.Zero(t, usage[csipb.VolumeUsage_BYTES].GetAvailable())
	assert.Equal(t, int64(len(files)), usage[csipb.VolumeUsage_INODES].GetUsed())

	_, err = n.node.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: "vol-2", VolumePath: target})
	assert.Equal(t, codes.NotFound, status.Code(err), "%v", err)
}

// TestAnnouncePublished tells the pod, once per publish, which revision its
// volume resolved to.
func TestAnnouncePublished(t *testing.T) {
	requireRoot(t)
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	commit, files := modelRepo(hub)
	var size int64
	for _, c := range files {
		size += c.Size()
	}
	announced := make(chan csi.Published, 4)
	n := newNode(t, hub, t.TempDir(), nodeOpts{announce: func(_ context.Context, p csi.Published) { announced <- p }})
	target := filepath.Join(n.root, "pods", "uid-1", "volumes", "kubernetes.io~csi", "weights", "mount")
	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model@main"})
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	select {
	case p := <-announced:
		assert.Equal(t, csi.Published{
			Namespace: "team-a", Pod: "pod-vol-1", PodUID: "uid-vol-1", Volume: "weights",
			Ref: "hf://org/model@main", Resolved: "hf://org/model@" + commit, Revision: commit,
			Files: len(files), Bytes: size,
		}, p)
	case <-time.After(10 * time.Second):
		t.Fatal("the publish was not announced")
	}
	n.publishReady("vol-1", target, map[string]string{csi.AttrModel: "hf://org/model@main"})
	select {
	case p := <-announced:
		t.Fatalf("a repeated publish was announced again: %+v", p)
	case <-time.After(200 * time.Millisecond):
	}
}

// TestReconcileLegacyRecord takes over a volume published when volumes were
// keyed by id alone: its hold comes back, and unpublishing it removes its
// record and tree.
func TestReconcileLegacyRecord(t *testing.T) {
	n, hub, root, opts, target := publishedUnderBudget(t)
	n.stop()

	// What the earlier agent left: the record and tree named by the id's hash.
	sum := sha256.Sum256([]byte("vol-1"))
	legacy := hex.EncodeToString(sum[:16])
	records, err := filepath.Glob(filepath.Join(root, "csi", "*.json"))
	require.NoError(t, err)
	require.Len(t, records, 1)
	key := strings.TrimSuffix(filepath.Base(records[0]), ".json")
	require.NoError(t, os.Rename(records[0], filepath.Join(root, "csi", legacy+".json")))
	trees := filepath.Join(root, "cache", "csi-volumes")
	require.NoError(t, os.Rename(filepath.Join(trees, key), filepath.Join(trees, legacy)))

	n = newNode(t, hub, root, opts)
	assert.False(t, n.evictsModel(), "the legacy volume's hold comes back")
	n.unpublish("vol-1", target)
	assert.NoFileExists(t, filepath.Join(root, "csi", legacy+".json"))
	assert.NoDirExists(t, filepath.Join(trees, legacy))
	assert.True(t, n.evictsModel())
}
