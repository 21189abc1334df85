// Command csi measures publishing a cached model as a CSI volume: a 100-file
// model is fetched once from an in-process hub, then published to fresh
// targets through the plugin's gRPC socket with real read-only bind mounts,
// as the kubelet does for each pod (it needs root). bytes_copied is measured,
// not assumed: every file of every volume whose inode is not its blob's
// counts its size.
//
//	go run ./bench/csi               # 200 publishes
//	go run ./bench/csi -quick        # 50 publishes
//
// The last line is one JSON object:
//
//	{"bench":"csi-publish","files":100,"model_bytes":…,"cached_p50_ms":…,"cached_p99_ms":…,"bytes_copied":0}
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
)

type result struct {
	Bench       string  `json:"bench"`
	Files       int     `json:"files"`
	ModelBytes  int64   `json:"model_bytes"`
	CachedP50MS float64 `json:"cached_p50_ms"`
	CachedP99MS float64 `json:"cached_p99_ms"`
	BytesCopied int64   `json:"bytes_copied"`
	Publishes   int     `json:"publishes"`
}

func main() {
	files := flag.Int("files", 100, "files in the model")
	fileSize := flag.Int64("file-size", 1<<20, "bytes per file")
	publishes := flag.Int("publishes", 200, "publishes measured")
	quick := flag.Bool("quick", false, "50 publishes")
	flag.Parse()
	if *quick {
		*publishes = 50
	}
	if os.Geteuid() != 0 {
		log.Fatal("bench/csi bind-mounts: run it as root")
	}
	res, err := run(*files, *fileSize, *publishes)
	if err != nil {
		log.Fatal(err)
	}
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
}

func run(nFiles int, fileSize int64, publishes int) (result, error) {
	res := result{Bench: "csi-publish", Files: nFiles, Publishes: publishes}
	dir, err := os.MkdirTemp("", "csibench")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)

	hub := hubtest.New()
	defer hub.Close()
	content := map[string]hubtest.Content{}
	for i := range nFiles {
		content[fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, nFiles)] = hubtest.Generated(fileSize, uint64(i))
		res.ModelBytes += fileSize
	}
	hub.AddRepo("bench/model", content)

	store, err := cache.Open(filepath.Join(dir, "cache"))
	if err != nil {
		return res, err
	}
	defer store.Close()
	src, err := hf.New(nil, hf.WithEndpoint(hub.URL), hf.WithVersion("bench"))
	if err != nil {
		return res, err
	}
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHF: src})
	driver, err := csi.NewDriver(store, queue, csi.Config{NodeID: "bench", StateDir: filepath.Join(dir, "state"), PublishWait: time.Minute})
	if err != nil {
		return res, err
	}
	sock := filepath.Join(dir, "csi.sock")
	srv, err := csi.NewServer(driver, "unix://"+sock, "")
	if err != nil {
		return res, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = queue.Run(ctx) }()
	go func() { _ = srv.Run(ctx) }()
	for range 1000 {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}))
	if err != nil {
		return res, err
	}
	defer conn.Close()
	node := csipb.NewNodeClient(conn)

	publish := func(i int) (string, error) {
		target := filepath.Join(dir, "pods", fmt.Sprint(i), "mount")
		_, err := node.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{
			VolumeId: fmt.Sprint("vol-", i), TargetPath: target, Readonly: true,
			VolumeCapability: &csipb.VolumeCapability{AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{}}},
			VolumeContext:    map[string]string{csi.AttrModel: "hf://bench/model@main", csi.AttrPodNamespace: "bench"},
		})
		return target, err
	}
	unpublish := func(i int, target string) error {
		_, err := node.NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: fmt.Sprint("vol-", i), TargetPath: target})
		return err
	}

	// The first publish fetches the model; it is not measured.
	target, err := publish(-1)
	for status.Code(err) == codes.Unavailable {
		target, err = publish(-1)
	}
	if err != nil {
		return res, fmt.Errorf("first publish: %w", err)
	}
	if err := unpublish(-1, target); err != nil {
		return res, err
	}

	lat := make([]time.Duration, 0, publishes)
	for i := range publishes {
		start := time.Now()
		target, err := publish(i)
		lat = append(lat, time.Since(start))
		if err != nil {
			return res, fmt.Errorf("publish %d: %w", i, err)
		}
		copied, err := bytesCopied(store, target)
		if err != nil {
			_ = unix.Unmount(target, unix.MNT_DETACH)
			return res, err
		}
		res.BytesCopied += copied
		if err := unpublish(i, target); err != nil {
			return res, err
		}
	}
	slices.Sort(lat)
	ms := func(q float64) float64 {
		return float64(lat[min(len(lat)-1, int(q*float64(len(lat))))].Microseconds()) / 1000
	}
	res.CachedP50MS, res.CachedP99MS = ms(0.50), ms(0.99)
	return res, nil
}

// bytesCopied sums the sizes of the volume's files that are not their blob's
// own inode.
func bytesCopied(store *cache.Store, target string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(target, "model.json"))
	if err != nil {
		return 0, err
	}
	var m content.Model
	if err := json.Unmarshal(b, &m); err != nil {
		return 0, err
	}
	var copied int64
	for _, f := range m.Files {
		blob, err := store.BlobPath(f.Digest)
		if err != nil {
			return 0, err
		}
		var sb, sf unix.Stat_t
		if err := unix.Stat(blob, &sb); err != nil {
			return 0, err
		}
		if err := unix.Stat(filepath.Join(target, f.Path), &sf); err != nil {
			return 0, err
		}
		if sb.Dev != sf.Dev || sb.Ino != sf.Ino {
			copied += f.Size
		}
	}
	return copied, nil
}
