// Command scrape measures a Prometheus scrape of an agent's metrics with
// 1,000 cached models, and the same scrape while a large model downloads.
//
// It runs an agent in-process, wired by internal/agent as `weightd agent`
// is (without peers, Kubernetes or the load tracer), with its metrics on
// loopback. Through its local API it fetches 1,000 small generated models
// from a local origin (internal/genmodel), so every per-model metric has
// seen 1,000 models. Then it times GETs of the agent's /metrics (the median
// of -scrapes). Then it fetches one large model and scrapes every 10 ms
// until the download ends.
//
// As on a node, the origin and the scraper are other processes than the
// agent: the origin is this program run again as a child (serving on a
// listener it inherits), and each scrape is a curl (gzip accepted, as
// Prometheus asks), timed by curl's time_total, so that the scrape competes
// with the download for the CPU, not with the origin's goroutines in the
// agent's runtime. It prints two JSON lines, the scrape with 1,000 models
// last:
//
//	{"bench":"scrape-during-download","models":1000,"download_bytes":…,"scrapes":…,"ms_p50":…,"ms_max":…}
//	{"bench":"scrape","models":1000,"bytes":…,"ms":…}
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/weightd/weightd/internal/agent"
	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
)

type scrapeResult struct {
	Bench  string  `json:"bench"`
	Models int     `json:"models"`
	Bytes  int     `json:"bytes"`
	Ms     float64 `json:"ms"`
}

type downloadResult struct {
	Bench         string  `json:"bench"`
	Models        int     `json:"models"`
	DownloadBytes int64   `json:"download_bytes"`
	Scrapes       int     `json:"scrapes"`
	MsP50         float64 `json:"ms_p50"`
	MsMax         float64 `json:"ms_max"`
}

func main() {
	models := flag.Int("models", 1000, "small models to cache")
	scrapes := flag.Int("scrapes", 50, "scrapes timed with the models cached")
	downloadMiB := flag.Int64("download-mib", 1024, "size of the model downloaded during the second measurement, in MiB")
	originDir := flag.String("serve-origin", "", "internal: serve this directory as the origin on the listener inherited as fd 3")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/scrape: ")
	if *originDir != "" {
		if err := serveOrigin(*originDir); err != nil {
			log.Fatal(err)
		}
		return
	}
	if err := run(*models, *scrapes, *downloadMiB<<20); err != nil {
		log.Fatal(err)
	}
}

// serveOrigin is the child process: it serves dir on the listener it
// inherits as fd 3 until its parent closes its stdin.
func serveOrigin(dir string) error {
	ln, err := net.FileListener(os.NewFile(3, "origin"))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	return genmodel.NewServer(ln, dir).Run(ctx)
}

// startOrigin runs this program again as the origin serving dir on
// loopback, and returns its base URL and a function that stops it.
func startOrigin(dir string) (string, func() error, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	defer ln.Close()
	lf, err := ln.(*net.TCPListener).File()
	if err != nil {
		return "", nil, err
	}
	defer lf.Close()
	self, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command(self, "-serve-origin", dir)
	cmd.ExtraFiles = []*os.File{lf}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop := func() error {
		stdin.Close()
		return cmd.Wait()
	}
	return "http://" + ln.Addr().String(), stop, nil
}

func run(models, scrapes int, downloadBytes int64) error {
	if models < 1 || scrapes < 1 || downloadBytes < 1<<20 {
		return errors.New("-models and -scrapes must be at least 1, -download-mib at least 1")
	}
	work, err := os.MkdirTemp("", "weightd-bench-scrape-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()

	// The origin: models small models, and one large one.
	originDir := filepath.Join(work, "origin")
	for i := range models {
		spec := genmodel.Spec{Name: fmt.Sprintf("bench/model-%04d", i), Files: 2, TotalBytes: 16 << 10, Seed: uint64(i)}
		if _, err := genmodel.Generate(filepath.Join(originDir, fmt.Sprintf("m%04d", i)), spec); err != nil {
			return err
		}
	}
	if _, err := genmodel.Generate(filepath.Join(originDir, "large"), genmodel.Spec{Name: "bench/large", Files: 8, TotalBytes: downloadBytes, Seed: 1}); err != nil {
		return err
	}
	originURL, stopOrigin, err := startOrigin(originDir)
	if err != nil {
		return fmt.Errorf("starting the origin: %w", err)
	}
	defer func() {
		if err := stopOrigin(); err != nil {
			log.Printf("origin: %v", err)
		}
	}()

	// The agent, its API on a unix socket and its metrics on loopback.
	sock := "unix://" + filepath.Join(work, "api.sock")
	a, err := agent.New(agent.Config{
		Root: filepath.Join(work, "cache"), API: sock, MetricsAddr: "127.0.0.1:0",
		ChunkSize: 16 << 20, MaxJobs: 8, ShutdownTimeout: 5 * time.Second,
		// The origin listens on loopback, which agents refuse to fetch
		// from unless told.
		SourcesConfig: agent.SourcesConfig{FetchAllowCIDRs: []string{"127.0.0.1/32"}},
	}, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	if err != nil {
		return err
	}
	wg.Go(func() {
		if err := a.Run(ctx); err != nil {
			log.Printf("agent: %v", err)
		}
	})
	client, err := api.NewClient(sock)
	if err != nil {
		return err
	}
	readyCtx, cancelReady := context.WithTimeout(ctx, 10*time.Second)
	err = client.WaitReady(readyCtx)
	cancelReady()
	if err != nil {
		return err
	}
	ids := make([]string, models)
	for i := range ids {
		st, err := client.Submit(ctx, api.FetchRequest{Ref: fmt.Sprintf("%s/m%04d/%s", originURL, i, genmodel.ManifestName), Priority: "background"})
		if err != nil {
			return err
		}
		ids[i] = st.ID
	}
	for _, id := range ids {
		st, err := client.Watch(ctx, id, nil)
		if err != nil {
			return err
		}
		if st.State != prefetch.StateReady {
			return fmt.Errorf("fetching %s: %s: %s", st.Ref, st.State, st.Error)
		}
	}
	url := "http://" + a.MetricsAddr() + "/metrics"

	idle := make([]time.Duration, scrapes)
	size := 0
	for i := range idle {
		if size, idle[i], err = scrape(ctx, url); err != nil {
			return err
		}
	}

	// The same scrape while the large model downloads.
	large, err := client.Submit(ctx, api.FetchRequest{Ref: originURL + "/large/" + genmodel.ManifestName, Priority: "pod"})
	if err != nil {
		return err
	}
	done := make(chan struct{})
	var final prefetch.JobStatus
	var watchErr error
	go func() {
		defer close(done)
		final, watchErr = client.Watch(ctx, large.ID, nil)
	}()
	var busy []time.Duration
	for {
		_, took, err := scrape(ctx, url)
		if err != nil {
			return err
		}
		select {
		case <-done:
		default:
			busy = append(busy, took)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		break
	}
	if watchErr != nil {
		return fmt.Errorf("fetching the large model: %w", watchErr)
	}
	if final.State != prefetch.StateReady {
		return fmt.Errorf("fetching the large model: %s: %s", final.State, final.Error)
	}
	if len(busy) == 0 {
		return errors.New("the large model downloaded before the first scrape ended: raise -download-mib")
	}

	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(downloadResult{
		Bench: "scrape-during-download", Models: models, DownloadBytes: downloadBytes,
		Scrapes: len(busy), MsP50: ms(benchfig.Median(busy)), MsMax: ms(slices.Max(busy)),
	}); err != nil {
		return err
	}
	return enc.Encode(scrapeResult{Bench: "scrape", Models: models, Bytes: size, Ms: ms(benchfig.Median(idle))})
}

// scrape GETs url with curl, as a scraper on another process would, and
// returns the size of the (gzipped) body and curl's time_total.
func scrape(ctx context.Context, url string) (int, time.Duration, error) {
	out, err := exec.CommandContext(ctx, "curl", "-sSf", "-o", "/dev/null", "-H", "Accept-Encoding: gzip",
		"-w", "%{size_download} %{time_total}", url).Output()
	if err != nil {
		return 0, 0, fmt.Errorf("scraping with curl: %w", err)
	}
	var size int
	var secs float64
	if _, err := fmt.Sscan(string(out), &size, &secs); err != nil {
		return 0, 0, fmt.Errorf("scraping with curl: reading %q: %w", out, err)
	}
	return size, time.Duration(secs * float64(time.Second)), nil
}

// ms is d in milliseconds, to the microsecond.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
