// Command modelsource measures resolve plus fetch of one multi-file model
// from each kind of model origin, against the plain ingest path in the same
// run. One generated model (1 GiB in 6 files by default: config, tokenizer,
// four safetensors shards) is served three ways, all on loopback:
//
//   - http: a weightd model.json manifest and its files on an HTTP origin:
//     the ingest path of the foundation issue, the baseline;
//   - hf: a repository on an in-process Hugging Face style hub
//     (internal/hubtest: the revision API, paginated tree listings, resolve
//     URLs redirecting LFS files to a CDN);
//   - oci: a CNCF ModelPack artifact in a real docker-registry (one raw
//     layer per file, its path in the org.cncf.model.filepath annotation).
//
// For each it starts a fresh `weightd agent` with an empty cache and times
// `weightd fetch REF --wait` as a client sees it: resolve, fetch every file
// verified into the cache, materialise the model directory. It prints one
// line per source:
//
//	{"bench":"model-source","source":"hf"|"oci","size_bytes":…,"seconds":…,"ratio_vs_ingest":…}
//
// with ratio_vs_ingest = http_seconds / seconds (1.0: the source costs
// nothing over plain ingest; above: faster), and the baseline's own line
// with "source":"http". Each source's best of -rounds counts.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/source/oci"
)

type result struct {
	Bench         string  `json:"bench"`
	Source        string  `json:"source"`
	SizeBytes     int64   `json:"size_bytes"`
	Files         int     `json:"files"`
	Seconds       float64 `json:"seconds"`
	RatioVsIngest float64 `json:"ratio_vs_ingest"`
}

func main() {
	sizeMiB := flag.Int64("size-mib", 1024, "model size, MiB")
	files := flag.Int("files", 6, "model files")
	rounds := flag.Int("rounds", 3, "rounds of each source; the best counts (a round now and then takes twice as long here, whatever the source: disk write-back)")
	bin := flag.String("weightd", "", "weightd binary (default: build ./cmd/weightd)")
	dir := flag.String("dir", "", "working directory (default: a new temporary directory, removed at the end)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/modelsource: ")
	if *sizeMiB < 1 || *files < 1 || *rounds < 1 {
		log.Fatal("-size-mib, -files and -rounds must be positive")
	}
	if err := services.RegistryAvailable(); err != nil {
		log.Fatal(err)
	}
	work := *dir
	if work == "" {
		var err error
		if work, err = os.MkdirTemp("", "wdms"); err != nil { // short: unix socket paths
			log.Fatal(err)
		}
		defer os.RemoveAll(work)
	}
	if *bin == "" {
		*bin = filepath.Join(work, "weightd")
		if out, err := exec.Command("go", "build", "-o", *bin, "./cmd/weightd").CombinedOutput(); err != nil {
			log.Fatalf("building weightd: %v\n%s", err, out)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := run(ctx, work, *bin, *sizeMiB<<20, *files, *rounds); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, work, bin string, size int64, files, rounds int) error {
	modelDir := filepath.Join(work, "model")
	m, err := genmodel.Generate(modelDir, genmodel.Spec{Name: "bench/model", Files: files, TotalBytes: size, Seed: 42})
	if err != nil {
		return err
	}

	// The three origins of the same bytes.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	httpOrigin := genmodel.NewServer(ln, modelDir)
	go func() { _ = httpOrigin.Run(ctx) }()

	hub := hubtest.New()
	defer hub.Close()
	hubFiles := make(map[string]hubtest.Content, len(m.Files))
	for _, f := range m.Files {
		c, err := hubtest.FromFile(filepath.Join(modelDir, f.Path))
		if err != nil {
			return err
		}
		hubFiles[f.Path] = c
	}
	hub.AddRepo("bench/model", hubFiles)

	reg, err := services.StartRegistry(ctx, services.RegistryConfig{Dir: filepath.Join(work, "registry")})
	if err != nil {
		return err
	}
	defer reg.Close()
	// The registry itself, not its byte-counting proxy: this bench measures
	// speed, not traffic.
	ociRef, err := pushModelPack(ctx, reg.DirectAddr(), modelDir, m)
	if err != nil {
		return err
	}

	sources := []struct{ name, ref string }{
		{"http", httpOrigin.URL() + "/" + genmodel.ManifestName},
		{"hf", "hf://bench/model@main"},
		{"oci", "oci://" + ociRef},
	}
	best := make(map[string]time.Duration)
	for r := range rounds {
		for i, s := range sources {
			root := filepath.Join(work, fmt.Sprintf("c%d%d", r, i))
			took, err := fetchOnce(ctx, bin, root, hub.URL, reg.DirectAddr(), s.ref)
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			log.Printf("round %d: %s %.2f s", r+1, s.name, took.Seconds())
			if b, ok := best[s.name]; !ok || took < b {
				best[s.name] = took
			}
			if err := os.RemoveAll(root); err != nil {
				return err
			}
		}
	}
	for _, s := range sources {
		if err := json.NewEncoder(os.Stdout).Encode(result{
			Bench: "model-source", Source: s.name, SizeBytes: m.TotalBytes(), Files: len(m.Files),
			Seconds: benchfig.Round(best[s.name].Seconds(), 3), RatioVsIngest: benchfig.Round(best["http"].Seconds()/best[s.name].Seconds(), 3),
		}); err != nil {
			return err
		}
	}
	return nil
}

// fetchOnce starts an agent on an empty cache at root and times one fetch
// of ref through its API.
func fetchOnce(ctx context.Context, bin, root, hubURL, registry, ref string) (time.Duration, error) {
	sock := "unix://" + root + ".sock"
	cmd := exec.CommandContext(ctx, bin, "agent", "--root", root, "--api", sock, "--metrics-addr", "", "--log-level", "warn",
		"--gossip-addr", "", "--chunk-addr", "", "--hf-endpoint", hubURL, "--insecure-registries", registry,
		"--fetch-allow-cidrs", "127.0.0.1/32") // the origins listen on loopback
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}()
	client, err := api.NewClient(sock)
	if err != nil {
		return 0, err
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err = client.WaitReady(rctx)
	cancel()
	if err != nil {
		return 0, err
	}
	syscall.Sync()
	start := time.Now()
	st, err := client.Submit(ctx, api.FetchRequest{Ref: ref})
	if err != nil {
		return 0, err
	}
	if st, err = client.Watch(ctx, st.ID, nil); err != nil {
		return 0, err
	}
	if st.State != prefetch.StateReady {
		return 0, fmt.Errorf("fetching %s: %s", ref, st.Error)
	}
	return time.Since(start), nil
}

// pushModelPack pushes the model as a ModelPack artifact, one raw layer per
// file, and returns its reference (registry/repository:tag).
func pushModelPack(ctx context.Context, registry, dir string, m *genmodel.Manifest) (string, error) {
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.MediaType(oci.MediaTypeModelConfig))
	for _, f := range m.Files {
		mt := "application/vnd.cnai.model.weight.v1.raw"
		if filepath.Ext(f.Path) == ".json" {
			mt = "application/vnd.cnai.model.weight.config.v1.raw"
		}
		l, err := newFileLayer(filepath.Join(dir, f.Path), f.SHA256, f.Size, types.MediaType(mt))
		if err != nil {
			return "", err
		}
		img, err = mutate.Append(img, mutate.Addendum{Layer: l, Annotations: map[string]string{oci.AnnotationModelFilepath: f.Path}})
		if err != nil {
			return "", err
		}
	}
	ref := registry + "/bench/model:v1"
	tag, err := name.NewTag(ref, name.Insecure)
	if err != nil {
		return "", err
	}
	if err := remote.Write(tag, img, remote.WithContext(ctx)); err != nil {
		return "", fmt.Errorf("pushing the ModelPack artifact: %w", err)
	}
	return ref, nil
}

// fileLayer is a raw (uncompressed, untarred) layer read from a file.
type fileLayer struct {
	path string
	d    v1.Hash
	size int64
	mt   types.MediaType
}

func newFileLayer(path, sha256hex string, size int64, mt types.MediaType) (*fileLayer, error) {
	h, err := v1.NewHash("sha256:" + sha256hex)
	if err != nil {
		return nil, err
	}
	return &fileLayer{path: path, d: h, size: size, mt: mt}, nil
}

func (l *fileLayer) Digest() (v1.Hash, error)             { return l.d, nil }
func (l *fileLayer) DiffID() (v1.Hash, error)             { return l.d, nil }
func (l *fileLayer) Size() (int64, error)                 { return l.size, nil }
func (l *fileLayer) MediaType() (types.MediaType, error)  { return l.mt, nil }
func (l *fileLayer) Compressed() (io.ReadCloser, error)   { return os.Open(l.path) }
func (l *fileLayer) Uncompressed() (io.ReadCloser, error) { return os.Open(l.path) }
