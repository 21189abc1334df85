package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/origin"
	"github.com/weightd/weightd/pkg/prefetch"
)

// demoCmd shows weightd end to end on one machine: an embedded origin serves
// a generated model, an in-process agent (wired exactly like `weightd agent`)
// fetches it through the local API, then fetches it again from the cache.
type demoCmd struct {
	Files    int        `help:"Files in the generated model." default:"8"`
	Size     byteSize   `help:"Total size of the generated model (units: KiB, MiB, GiB, kB, MB, GB)." default:"1GiB"`
	Keep     bool       `help:"Keep the working directory (origin files, cache) and keep the agent and origin running until Ctrl-C."`
	Dir      string     `help:"Working directory (default: a new temporary directory)." type:"path"`
	LogLevel slog.Level `help:"Log level of the embedded agent." default:"warn" env:"WEIGHTD_LOG_LEVEL"`
}

// demoModel is the name of the generated model.
const demoModel = "weightd/demo-model"

// demoResult is what the demo measured.
type demoResult struct {
	manifest    *origin.Manifest
	ref         string
	first       prefetch.JobStatus
	firstTime   time.Duration
	second      prefetch.JobStatus
	secondTime  time.Duration
	servedFirst int64 // origin bytes sent during the first fetch
	servedAgain int64 // origin bytes sent during the second fetch
	metrics     []string
}

func (c *demoCmd) Run(e *env) (err error) {
	if c.Files < 1 {
		return fmt.Errorf("--files must be at least 1, not %d", c.Files)
	}
	dir, cleanup, err := c.workDir()
	if err != nil {
		return err
	}
	defer func() {
		if c.Keep {
			fmt.Fprintf(e.stdout, "kept %s\n", dir)
			return
		}
		err = errors.Join(err, cleanup())
	}()
	originDir, cacheDir := filepath.Join(dir, "origin"), filepath.Join(dir, "cache")
	log := newLogger(e.stderr, c.LogLevel, "text")

	fmt.Fprintf(e.stderr, "generating %s: %d files, %s in %s\n", demoModel, c.Files, formatBytes(int64(c.Size)), originDir)
	t0 := time.Now()
	m, err := origin.Generate(originDir, origin.Spec{Name: demoModel, Files: c.Files, TotalBytes: int64(c.Size), Seed: 1})
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stderr, "generated in %s\n", time.Since(t0).Round(time.Millisecond))
	manifestInfo, err := os.Stat(filepath.Join(originDir, origin.ManifestName))
	if err != nil {
		return err
	}

	apiAddr := "unix://" + filepath.Join(dir, "weightd.sock")
	client, err := api.NewClient(apiAddr)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("listening for the origin: %w", err)
	}
	org := origin.NewServer(ln, originDir)
	a, err := newAgent(agentConfig{
		Root:            cacheDir,
		API:             apiAddr,
		MetricsAddr:     "127.0.0.1:0",
		ChunkSize:       cache.DefaultChunkSize,
		BudgetPercent:   90,
		MaxJobs:         prefetch.DefaultJobConcurrency,
		ShutdownTimeout: 5 * time.Second,
	}, log)
	if err != nil {
		ln.Close()
		return err
	}

	ctx, cancel := context.WithCancel(e.ctx)
	defer cancel()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return org.Run(gctx) })
	g.Go(func() error { return a.Run(gctx) })
	g.Go(func() error {
		res, err := demoScript(gctx, client, org, m, manifestInfo.Size(), a.MetricsAddr(), e.stderr)
		if err != nil {
			return err
		}
		printDemoSummary(e.stdout, res, a.MetricsAddr(), apiAddr, cacheDir)
		if c.Keep {
			fmt.Fprintln(e.stdout, "\nthe agent and origin keep running; press Ctrl-C to stop")
			<-gctx.Done()
		}
		cancel()
		return nil
	})
	return g.Wait()
}

// workDir returns the demo's working directory and how to remove what the
// demo put there.
func (c *demoCmd) workDir() (string, func() error, error) {
	if c.Dir == "" {
		dir, err := os.MkdirTemp("", "weightd-demo-")
		return dir, func() error { return os.RemoveAll(dir) }, err
	}
	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return "", nil, err
	}
	return c.Dir, func() error {
		return errors.Join(
			os.RemoveAll(filepath.Join(c.Dir, "origin")),
			os.RemoveAll(filepath.Join(c.Dir, "cache")),
		)
	}, nil
}

// demoScript is the client side of the demo: wait for the agent, fetch the
// model, fetch it again, check that the second fetch came from the cache and
// read the agent's metrics.
func demoScript(ctx context.Context, client *api.Client, org *origin.Server, m *origin.Manifest, manifestSize int64, metricsAddr string, progressTo io.Writer) (*demoResult, error) {
	readyCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := client.WaitReady(readyCtx); err != nil {
		return nil, err
	}
	res := &demoResult{manifest: m, ref: org.URL() + "/" + origin.ManifestName}
	fetch := func(label string) (prefetch.JobStatus, time.Duration, int64, error) {
		fmt.Fprintf(progressTo, "%s fetch of %s\n", label, res.ref)
		before, t0 := org.BytesServed(), time.Now()
		st, err := fetchAndWait(ctx, client, res.ref, progressTo)
		took, served := time.Since(t0), org.BytesServed()-before
		if err == nil && st.State != prefetch.StateReady {
			err = fmt.Errorf("%s fetch failed: %s", label, st.Error)
		}
		return st, took, served, err
	}
	var err error
	if res.first, res.firstTime, res.servedFirst, err = fetch("first"); err != nil {
		return nil, err
	}
	if res.second, res.secondTime, res.servedAgain, err = fetch("second"); err != nil {
		return nil, err
	}
	// The second fetch resolves the manifest again; no file byte may come
	// from the origin.
	if res.servedAgain > manifestSize {
		return nil, fmt.Errorf("the second fetch was not served from the cache: the origin sent %d bytes (the manifest is %d)", res.servedAgain, manifestSize)
	}
	if res.first.Dir != res.second.Dir {
		return nil, fmt.Errorf("the two fetches gave different directories: %s and %s", res.first.Dir, res.second.Dir)
	}
	if res.metrics, err = scrapeMetrics(ctx, metricsAddr); err != nil {
		return nil, err
	}
	return res, nil
}

// scrapeMetrics reads the agent's /metrics and keeps the weightd_ samples
// that are not zero, without histogram buckets and per-route API counters.
func scrapeMetrics(ctx context.Context, addr string) ([]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("reading metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("reading metrics: %s", resp.Status)
	}
	var out []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		name, _, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		if strings.HasPrefix(name, "weightd_") && !strings.HasSuffix(name, "_bucket") &&
			name != "weightd_api_requests_total" && !strings.HasSuffix(line, " 0") {
			out = append(out, line)
		}
	}
	return out, sc.Err()
}

func printDemoSummary(w io.Writer, r *demoResult, metricsAddr, apiAddr, cacheDir string) {
	total := r.manifest.TotalBytes()
	mbps := func(d time.Duration) float64 { return float64(total) / 1e6 / max(d.Seconds(), 1e-9) }
	fmt.Fprintf(w, "\nweightd demo: summary\n")
	fmt.Fprintf(w, "  model          %s@%s, %d files, %s (%d bytes)\n", r.manifest.Name, r.manifest.Revision[:12], len(r.manifest.Files), formatBytes(total), total)
	fmt.Fprintf(w, "  reference      %s\n", r.ref)
	fmt.Fprintf(w, "  first fetch    %.2f s, %.1f MB/s (origin → verified on disk); origin sent %d bytes\n",
		r.firstTime.Seconds(), mbps(r.firstTime), r.servedFirst)
	fmt.Fprintf(w, "  second fetch   %.3f s, cache hit; origin sent %d bytes (the manifest only)\n", r.secondTime.Seconds(), r.servedAgain)
	fmt.Fprintf(w, "  origin total   %d bytes served for %d bytes of model fetched twice\n", r.servedFirst+r.servedAgain, 2*total)
	fmt.Fprintf(w, "  model dir      %s\n", r.first.Dir)
	for _, l := range listLinks(r.first.Dir, 3) {
		fmt.Fprintf(w, "                   %s\n", l)
	}
	fmt.Fprintf(w, "  use it         HF_HUB_CACHE=%s finds %s at revision %s (hub layout, no copy)\n",
		filepath.Join(cacheDir, "models"), r.manifest.Name, r.manifest.Revision)
	fmt.Fprintf(w, "  agent status   weightd status --api %s\n", apiAddr)
	fmt.Fprintf(w, "  metrics        curl -s http://%s/metrics | grep weightd_   (live while the demo runs; --keep keeps it up)\n", metricsAddr)
	for _, m := range r.metrics {
		fmt.Fprintf(w, "                   %s\n", m)
	}
}

// listLinks describes up to n entries of the model directory like `ls -l`
// shows symlinks, and how many more there are.
func listLinks(dir string, n int) []string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for i, e := range entries {
		if i == n {
			out = append(out, fmt.Sprintf("… and %d more", len(entries)-n))
			break
		}
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			out = append(out, e.Name())
			continue
		}
		out = append(out, fmt.Sprintf("%s -> %s", e.Name(), target))
	}
	return out
}
