package agent

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/csi"
)

// TestAgentServesCSIVolume starts the agent with --csi-endpoint and mounts a
// model from an origin through its socket as the kubelet would, then
// unmounts it.
func TestAgentServesCSIVolume(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI=true but bind mounts need root")
		}
		t.Skip("skipping: bind mounts need root")
	}
	manifest, _ := startOrigin(t, 3, 3<<20)
	dir := testdisk.ShortDir(t)
	sock := filepath.Join(dir, "plugins", "csi.sock")
	kubelet := filepath.Join(dir, "kubelet")
	addr := startAgentWith(t, func(c *Config) {
		c.CSIConfig = CSIConfig{CSIEndpoint: "unix://" + sock, KubeletRegistrationDir: filepath.Join(dir, "registry"), KubeletDir: kubelet}
	})
	if _, err := os.Stat(filepath.Join(dir, "registry", csi.RegistrationSocketName)); err != nil {
		t.Fatalf("registration socket: %v", err)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	node := csipb.NewNodeClient(conn)
	target := filepath.Join(kubelet, "pods", "uid", "volumes", "kubernetes.io~csi", "model", "mount")
	t.Cleanup(func() { _ = unix.Unmount(target, unix.MNT_DETACH) })
	req := &csipb.NodePublishVolumeRequest{
		VolumeId: "csi-1", TargetPath: target, Readonly: true,
		VolumeCapability: &csipb.VolumeCapability{AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}}},
		VolumeContext:    map[string]string{csi.AttrModel: manifest, csi.AttrPodNamespace: "default", csi.AttrPodName: "p"},
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err = node.NodePublishVolume(t.Context(), req)
		if status.Code(err) != codes.Unavailable || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	var m content.Model
	if b, err := os.ReadFile(filepath.Join(target, "model.json")); err != nil || json.Unmarshal(b, &m) != nil || len(m.Files) != 3 {
		t.Fatalf("model.json: %v %+v", err, m)
	}
	for _, f := range m.Files {
		if st, err := os.Stat(filepath.Join(target, f.Path)); err != nil || st.Size() != f.Size {
			t.Errorf("%s: %v", f.Path, err)
		}
	}
	// The agent's status shows what holds the model's blobs.
	client, err := api.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	st, err := client.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := api.Volume{ID: "csi-1", Namespace: "default", Pod: "p", PodUID: "uid", Name: "model", Ref: manifest, Blobs: 3, Bytes: 3 << 20}
	if len(st.Volumes) != 1 || st.Volumes[0] != want {
		t.Errorf("status volumes %+v, want %+v", st.Volumes, want)
	}
	if _, err := node.NodeUnpublishVolume(t.Context(), &csipb.NodeUnpublishVolumeRequest{VolumeId: "csi-1", TargetPath: target}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(target); !os.IsNotExist(err) {
		t.Fatalf("target after unpublish: %v", err)
	}
	if st, err = client.Status(t.Context()); err != nil || len(st.Volumes) != 0 {
		t.Errorf("status volumes after unpublish: %+v, %v", st.Volumes, err)
	}
}

// TestAgentRefusesBadCSIAllowlist fails at start on a malformed allowlist.
func TestAgentRefusesBadCSIAllowlist(t *testing.T) {
	dir := testdisk.ShortDir(t)
	_, err := New(Config{
		Root: filepath.Join(dir, "cache"), API: "unix://" + filepath.Join(dir, "api.sock"), ChunkSize: 1 << 20, MaxJobs: 1, ShutdownTimeout: time.Second,
		CSIConfig: CSIConfig{CSIEndpoint: "unix://" + filepath.Join(dir, "csi.sock"), CSIAllowedRefs: "team-a"},
	}, slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), "--csi-allowed-refs") {
		t.Fatalf("New: %v, want a --csi-allowed-refs error", err)
	}
}
