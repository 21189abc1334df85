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
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/agent"
	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/pkg/prefetch"
)

// demoCmd shows weightd end to end on one machine: an embedded origin serves
// a generated model; in-process agents (wired exactly like `weightd agent`)
// that share chunks peer-to-peer on loopback all fetch it at once through
// their local APIs; the first agent then fetches it again from its cache.
type demoCmd struct {
	Files     int           `help:"Files in the generated model." default:"8"`
	Size      bytesize.Size `help:"Total size of the generated model (units: KiB, MiB, GiB, kB, MB, GB)." default:"1GiB"`
	Agents    int           `help:"Agents that fetch the model at once, sharing chunks on loopback (1: no peers)." default:"3"`
	ChunkSize bytesize.Size `help:"Chunk size of the agents: the unit of transfer between peers (a multiple of 64KiB)." default:"16MiB"`
	Keep      bool          `help:"Keep the working directory (origin files, caches) and keep the agents and origin running until Ctrl-C."`
	Dir       string        `help:"Working directory (default: a new temporary directory)." type:"path"`
	LogLevel  slog.Level    `help:"Log level of the embedded agents." default:"warn" env:"WEIGHTD_LOG_LEVEL"`
}

// demoModel is the name of the generated model.
const demoModel = "weightd/demo-model"

// maxDemoAgents bounds --agents: each agent is named by a letter.
const maxDemoAgents = 26

// Bounds on the demo's waits for its own components.
const (
	demoStartTimeout = 10 * time.Second // an agent's gossip and API come up
	demoJoinTimeout  = 15 * time.Second // every agent sees every other
)

// demoAgent is one of the demo's in-process agents.
type demoAgent struct {
	name   string
	dir    string // its cache and API socket are in there
	agent  *agent.Agent
	client *api.Client
	api    string
	stop   context.CancelFunc // set by start
	done   chan struct{}      // closed when Run has returned
}

func (d *demoAgent) cacheDir() string { return filepath.Join(d.dir, "cache") }

// start runs the agent in g until stop is called; it keeps ctx's values
// but not its cancellation, so that the agents can be stopped in order.
func (d *demoAgent) start(ctx context.Context, g *errgroup.Group) {
	ctx, d.stop = context.WithCancel(context.WithoutCancel(ctx))
	d.done = make(chan struct{})
	g.Go(func() error {
		defer close(d.done)
		return d.agent.Run(ctx)
	})
}

// stopDemoAgents stops the agents one after the other, the last started
// first, so that each leaves the cluster while its peers still listen.
func stopDemoAgents(agents []*demoAgent) {
	for _, a := range slices.Backward(agents) {
		a.stop()
		<-a.done
	}
}

// demoFetch is what one agent's first fetch took.
type demoFetch struct {
	status     prefetch.JobStatus
	took       time.Duration // from the moment all agents were asked
	fromOrigin int64         // verified chunk bytes it received from the origin
	fromPeers  int64         // and from peers
}

// demoResult is what the demo measured.
type demoResult struct {
	manifest    *genmodel.Manifest
	ref         string
	chunkSize   int64
	first       []demoFetch // one per agent, all asked at once
	second      prefetch.JobStatus
	secondTime  time.Duration
	servedFirst int64 // origin bytes sent during the first round
	servedAgain int64 // origin bytes sent during the second fetch
	metrics     []string
}

func (c *demoCmd) Run(e *env) (err error) {
	if c.Files < 1 {
		return fmt.Errorf("--files must be at least 1, not %d", c.Files)
	}
	if c.Agents < 1 || c.Agents > maxDemoAgents {
		return fmt.Errorf("--agents must be between 1 and %d, not %d", maxDemoAgents, c.Agents)
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
	originDir := filepath.Join(dir, "origin")
	log := newLogger(e.stderr, c.LogLevel, "text")

	fmt.Fprintf(e.stderr, "generating %s: %d files, %s in %s\n", demoModel, c.Files, bytesize.IEC(int64(c.Size)), originDir)
	t0 := time.Now()
	m, err := genmodel.Generate(originDir, genmodel.Spec{Name: demoModel, Files: c.Files, TotalBytes: int64(c.Size), Seed: 1})
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stderr, "generated in %s\n", time.Since(t0).Round(time.Millisecond))
	manifestInfo, err := os.Stat(filepath.Join(originDir, genmodel.ManifestName))
	if err != nil {
		return err
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("listening for the origin: %w", err)
	}
	org := genmodel.NewServer(ln, originDir)
	// The agents talk mutual TLS, as in a cluster, with a CA of the demo's.
	var ca peertls.Files
	if c.Agents > 1 {
		caDir := filepath.Join(dir, demoCADir)
		err = os.MkdirAll(caDir, 0o700)
		if err == nil {
			ca, err = peertls.WriteCA(caDir, "weightd demo CA")
		}
		if err != nil {
			ln.Close()
			return err
		}
	}
	// The first agent runs before the others are built: they join it at its
	// gossip address, known once its gossip is up.
	first, err := c.newDemoAgent(dir, 0, nil, ca, log)
	if err != nil {
		ln.Close()
		return err
	}
	agents := []*demoAgent{first}

	ctx, cancel := context.WithCancel(e.ctx)
	defer cancel()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return org.Run(gctx) })
	first.start(gctx, g)
	g.Go(func() error {
		// However the demo ends (done, failed, Ctrl-C), stop the agents
		// in order, then the origin.
		defer cancel()
		defer func() { stopDemoAgents(agents) }()
		if c.Agents > 1 {
			join, err := gossipAddr(gctx, first)
			if err != nil {
				return err
			}
			for i := 1; i < c.Agents; i++ {
				a, err := c.newDemoAgent(dir, i, []string{join}, ca, log)
				if err != nil {
					return err
				}
				agents = append(agents, a)
				a.start(gctx, g)
			}
		}
		res, err := demoScript(gctx, agents, org, m, manifestInfo.Size(), int64(c.ChunkSize), e.stderr)
		if err != nil {
			return err
		}
		printDemoSummary(e.stdout, res, agents)
		if c.Keep {
			fmt.Fprintln(e.stdout, "\nthe agents and origin keep running; press Ctrl-C to stop")
			<-gctx.Done()
		}
		return nil
	})
	return g.Wait()
}

// demoCADir is where in its directory the demo keeps its agents' peer CA.
const demoCADir = "peer-ca"

// demoNodeName names the demo's i-th agent: demo-a, demo-b, …
func demoNodeName(i int) string { return "demo-" + string(rune('a'+i)) }

// newDemoAgent builds the i-th agent in dir/<its name>, sharing on loopback
// through the peers in join, over mutual TLS with ca, when the demo has
// more than one agent.
func (c *demoCmd) newDemoAgent(dir string, i int, join []string, ca peertls.Files, log *slog.Logger) (*demoAgent, error) {
	d := &demoAgent{name: demoNodeName(i), dir: filepath.Join(dir, demoNodeName(i))}
	d.api = "unix://" + filepath.Join(d.dir, "weightd.sock")
	cfg := agent.Config{
		Root:            d.cacheDir(),
		API:             d.api,
		MetricsAddr:     "127.0.0.1:0",
		ChunkSize:       c.ChunkSize,
		BudgetPercent:   90,
		MaxJobs:         prefetch.DefaultJobConcurrency,
		ShutdownTimeout: 5 * time.Second,
		Version:         version,
		Commit:          commit,
		// The embedded origin listens on loopback, which agents refuse to
		// fetch from unless told.
		SourcesConfig: agent.SourcesConfig{FetchAllowCIDRs: []string{"127.0.0.1/32"}},
	}
	if c.Agents > 1 {
		// memberlist's LAN timings, not FastGossip's: on a loaded machine
		// (two cores, the race detector) FastGossip's 150 ms probe timeout
		// declares live agents dead, and a peer declared dead is forgotten
		// with its holdings, so a second agent takes the origin role for
		// blobs already being fetched.
		cfg.P2PConfig = agent.P2PConfig{
			GossipAddr:     "127.0.0.1:0",
			ChunkAddr:      "127.0.0.1:0",
			Join:           join,
			NodeName:       d.name,
			OriginFetchers: 2,
			MaxUploads:     4,
			MaxPeerUploads: 4, // every agent comes from 127.0.0.1: one address is every peer
			PeerCAFile:     ca.CA,
			PeerCAKeyFile:  ca.Key,
		}
	}
	var err error
	if d.client, err = api.NewClient(d.api); err != nil {
		return nil, err
	}
	if d.agent, err = agent.New(cfg, log.With("node", d.name)); err != nil {
		return nil, fmt.Errorf("starting %s: %w", d.name, err)
	}
	return d, nil
}

// gossipAddr waits until a's gossip is up and returns the address peers
// join it at.
func gossipAddr(ctx context.Context, a *demoAgent) (string, error) {
	timer := time.NewTimer(demoStartTimeout)
	defer timer.Stop()
	select {
	case <-a.agent.Membership().Ready():
		return a.agent.Membership().LocalAddr(), nil
	case <-timer.C:
		return "", fmt.Errorf("%s: gossip not up after %s", a.name, demoStartTimeout)
	case <-ctx.Done():
		return "", ctx.Err()
	}
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
		errs := []error{os.RemoveAll(filepath.Join(c.Dir, "origin")), os.RemoveAll(filepath.Join(c.Dir, demoCADir))}
		for i := range c.Agents {
			errs = append(errs, os.RemoveAll(filepath.Join(c.Dir, demoNodeName(i))))
		}
		return errors.Join(errs...)
	}, nil
}

// demoOriginBound is the most the origin may send while the agents fetch m
// at once: one copy, and two chunks more per blob of several chunks. A
// blob's two origin fetchers meet from opposite ends of its chunks, and
// where word of each other's requests comes late (a busy CPU) both fetch
// the chunk or two where they meet.
func demoOriginBound(m *genmodel.Manifest, chunkSize int64) int64 {
	bound := m.TotalBytes()
	for _, f := range m.Files {
		if f.Size > chunkSize {
			bound += 2 * chunkSize
		}
	}
	return bound
}

// demoScript is the client side of the demo: wait for the agents and for
// them to find each other, have all of them fetch the model at once, have
// the first fetch it again, check that the origin sent about one copy, that
// every agent holds the same files and that the second fetch came from the
// cache, and read the agents' metrics.
func demoScript(ctx context.Context, agents []*demoAgent, org *genmodel.Server, m *genmodel.Manifest, manifestSize, chunkSize int64, progressTo io.Writer) (*demoResult, error) {
	for _, a := range agents {
		readyCtx, cancel := context.WithTimeout(ctx, demoStartTimeout)
		err := a.client.WaitReady(readyCtx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
	}
	if len(agents) > 1 {
		if err := waitForPeers(ctx, agents, demoJoinTimeout); err != nil {
			return nil, err
		}
	}
	res := &demoResult{manifest: m, ref: org.URL() + "/" + genmodel.ManifestName, chunkSize: chunkSize, first: make([]demoFetch, len(agents))}

	if len(agents) == 1 {
		fmt.Fprintf(progressTo, "first fetch of %s\n", res.ref)
	} else {
		fmt.Fprintf(progressTo, "first fetch of %s by all %d agents at once; progress of %s:\n", res.ref, len(agents), agents[0].name)
	}
	before, t0 := org.BytesServed(), time.Now()
	fg, fctx := errgroup.WithContext(ctx)
	for i, a := range agents {
		fg.Go(func() error {
			var st prefetch.JobStatus
			var err error
			if i == 0 {
				st, err = fetchAndWait(fctx, a.client, api.FetchRequest{Ref: res.ref}, progressTo)
			} else if st, err = a.client.Fetch(fctx, res.ref); err == nil {
				st, err = a.client.Watch(fctx, st.ID, nil)
			}
			res.first[i].took = time.Since(t0)
			if err == nil && st.State != prefetch.StateReady {
				err = fmt.Errorf("first fetch failed: %s", st.Error)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", a.name, err)
			}
			res.first[i].status = st
			return nil
		})
	}
	if err := fg.Wait(); err != nil {
		return nil, err
	}
	res.servedFirst = org.BytesServed() - before
	if total, bound := m.TotalBytes(), demoOriginBound(m, chunkSize); len(agents) > 1 && res.servedFirst > bound {
		return nil, fmt.Errorf("the origin sent %d bytes for %d agents fetching %d bytes at once, %.2f× the model: sharing between peers should keep it near one copy (at most %d bytes)",
			res.servedFirst, len(agents), total, float64(res.servedFirst)/float64(total), bound)
	}
	if err := sameModelFiles(agents, res.first, len(m.Files)); err != nil {
		return nil, err
	}

	fmt.Fprintf(progressTo, "second fetch of %s by %s\n", res.ref, agents[0].name)
	before, t0 = org.BytesServed(), time.Now()
	st, err := fetchAndWait(ctx, agents[0].client, api.FetchRequest{Ref: res.ref}, progressTo)
	res.second, res.secondTime, res.servedAgain = st, time.Since(t0), org.BytesServed()-before
	if err == nil && st.State != prefetch.StateReady {
		err = fmt.Errorf("second fetch failed: %s", st.Error)
	}
	if err != nil {
		return nil, err
	}
	// The second fetch resolves the manifest again; no file byte may come
	// from the origin.
	if res.servedAgain > manifestSize {
		return nil, fmt.Errorf("the second fetch was not served from the cache: the origin sent %d bytes (the manifest is %d)", res.servedAgain, manifestSize)
	}
	if res.first[0].status.Dir != res.second.Dir {
		return nil, fmt.Errorf("the two fetches gave different directories: %s and %s", res.first[0].status.Dir, res.second.Dir)
	}

	for i, a := range agents {
		metrics, err := scrapeMetrics(ctx, a.agent.MetricsAddr())
		if err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		if res.first[i].fromOrigin, err = sample(metrics, `weightd_p2p_received_bytes_total{source="origin"}`); err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		if res.first[i].fromPeers, err = sample(metrics, `weightd_p2p_received_bytes_total{source="peer"}`); err != nil {
			return nil, fmt.Errorf("%s: %w", a.name, err)
		}
		if i == 0 {
			res.metrics = metrics
		}
	}
	return res, nil
}

// waitForPeers waits until every agent sees every other with its chunk
// server's address, for at most timeout.
func waitForPeers(ctx context.Context, agents []*demoAgent, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		var waiting string
		for _, a := range agents {
			seen := 0
			for _, p := range a.agent.Membership().Members() {
				if p.Meta.ChunkAddr != "" {
					seen++
				}
			}
			if seen < len(agents)-1 {
				waiting = fmt.Sprintf("%s sees %d of its %d peers", a.name, seen, len(agents)-1)
				break
			}
		}
		if waiting == "" {
			return nil
		}
		select {
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
				return fmt.Errorf("the agents did not find each other within %s: %s", timeout, waiting)
			}
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// sameModelFiles checks that every agent's model directory holds the
// manifest's files, linked to the same blobs as the first agent's.
func sameModelFiles(agents []*demoAgent, fetches []demoFetch, files int) error {
	var want []string
	for i, f := range fetches {
		got, err := modelFiles(f.status.Dir)
		if err != nil {
			return fmt.Errorf("%s: reading the model directory: %w", agents[i].name, err)
		}
		if len(got) != files {
			return fmt.Errorf("%s: the model directory %s holds %d files, the manifest lists %d", agents[i].name, f.status.Dir, len(got), files)
		}
		if i == 0 {
			want = got
		} else if !slices.Equal(got, want) {
			return fmt.Errorf("%s's model directory differs from %s's:\n  %s\nand\n  %s",
				agents[i].name, agents[0].name, strings.Join(got, "\n  "), strings.Join(want, "\n  "))
		}
	}
	return nil
}

// modelFiles lists a model directory's entries as "name -> target", sorted
// by name; the targets name the blobs by digest.
func modelFiles(dir string) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(entries))
	for _, e := range entries {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, err
		}
		out = append(out, e.Name()+" -> "+target)
	}
	return out, nil
}

// scrapeMetrics reads an agent's /metrics and keeps the weightd_ samples
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

// sample returns the value of series (a metric name with its labels, as
// /metrics writes it) in samples, or 0 if it is not there.
func sample(samples []string, series string) (int64, error) {
	for _, line := range samples {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return 0, fmt.Errorf("reading metric %s: %w", series, err)
			}
			return int64(f), nil
		}
	}
	return 0, nil
}

func printDemoSummary(w io.Writer, r *demoResult, agents []*demoAgent) {
	total := r.manifest.TotalBytes()
	mbps := func(d time.Duration) float64 { return float64(total) / 1e6 / max(d.Seconds(), 1e-9) }
	const (
		cont = "                 "   // a continued value
		item = "                   " // an item under a value
	)
	fmt.Fprintf(w, "\nweightd demo: summary\n")
	fmt.Fprintf(w, "  model          %s@%s, %d files, %s (%d bytes)\n", r.manifest.Name, r.manifest.Revision[:12], len(r.manifest.Files), bytesize.IEC(total), total)
	fmt.Fprintf(w, "  reference      %s\n", r.ref)
	ratio := float64(r.servedFirst) / float64(total)
	if len(agents) == 1 {
		fmt.Fprintf(w, "  agents         1 (no peers to share with), %s chunks\n", bytesize.IEC(r.chunkSize))
		fmt.Fprintf(w, "  first fetch    origin sent %d bytes, %.2f× the model\n", r.servedFirst, ratio)
	} else {
		fmt.Fprintf(w, "  agents         %d in this process, sharing %s chunks peer-to-peer on loopback\n", len(agents), bytesize.IEC(r.chunkSize))
		fmt.Fprintf(w, "  first fetch    all %d agents at once; origin sent %d bytes, %.2f× the model\n", len(agents), r.servedFirst, ratio)
	}
	for i, f := range r.first {
		fmt.Fprintf(w, "%s%s  %.2f s, %.1f MB/s", item, agents[i].name, f.took.Seconds(), mbps(f.took))
		if len(agents) == 1 {
			fmt.Fprintf(w, " (origin → verified on disk)\n")
			continue
		}
		fmt.Fprintf(w, "; received %s from the origin, %s from peers\n", bytesize.IEC(f.fromOrigin), bytesize.IEC(f.fromPeers))
	}
	fmt.Fprintf(w, "  second fetch   %s  %.3f s, cache hit; origin sent %d bytes (the manifest only)\n", agents[0].name, r.secondTime.Seconds(), r.servedAgain)
	fmt.Fprintf(w, "  origin total   %d bytes served for %d bytes of model fetched %d times\n", r.servedFirst+r.servedAgain, int64(len(agents)+1)*total, len(agents)+1)
	fmt.Fprintf(w, "  model dir      %s\n", r.first[0].status.Dir)
	for _, l := range listLinks(r.first[0].status.Dir, 3) {
		fmt.Fprintf(w, "%s%s\n", item, l)
	}
	if len(agents) > 1 {
		fmt.Fprintf(w, "%s(%s's; every agent's holds the same files, linked to the same blobs)\n", cont, agents[0].name)
	}
	fmt.Fprintf(w, "  use it         HF_HUB_CACHE=%s finds %s at revision %s (hub layout, no copy)\n",
		filepath.Join(agents[0].cacheDir(), "models"), r.first[0].status.Model, r.first[0].status.Revision)
	label := func(i int, first string) string {
		if i == 0 {
			return first
		}
		return cont
	}
	for i, a := range agents {
		fmt.Fprintf(w, "%s%s  weightd status --api %s\n", label(i, "  agent status   "), a.name, a.api)
	}
	for i, a := range agents {
		fmt.Fprintf(w, "%s%s  curl -s http://%s/metrics | grep weightd_\n", label(i, "  metrics        "), a.name, a.agent.MetricsAddr())
	}
	fmt.Fprintf(w, "%s(live while the demo runs; --keep keeps them up); %s's non-zero samples now:\n", cont, agents[0].name)
	for _, m := range r.metrics {
		fmt.Fprintf(w, "%s%s\n", item, m)
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
