// Command swarm measures how long N weightd agents, each on its own host,
// take to hold one blob of S bytes when every host's link carries B bit/s,
// against the physical limit S/B and against the naive baseline of every
// host downloading the blob from the origin.
//
// It builds a testbed (internal/testbed: network namespaces on a bridge, so
// it needs root and iproute2) of one origin host and N agent hosts, every
// link shaped to B in both directions. The origin (internal/genmodel, serving a
// generated blob) runs in the origin host: the bench re-executes itself
// there, and reads the origin's egress through a unix socket. The naive
// baseline re-executes the bench in each agent host as a downloader, all
// started at the same moment; naive_last_s is when the last one has the
// whole blob, verified. Then, for each mode, fresh agents with empty caches
// (`weightd agent`, one per host, joined into one swarm when the agent has
// the peer-to-peer flags) are asked through their API to fetch the blob:
//
//   - simultaneous: all at the same moment;
//   - staggered: one per second, each timed from its own request;
//   - churn: all at once, and the last agent is killed (SIGKILL) when it
//     holds half the blob; the figures are over the survivors.
//
// Each mode prints one JSON line on stdout (logs go to stderr):
//
//	{"bench":"swarm","mode":"simultaneous","nodes":N,"size_bytes":S,"link_mbit":B,
//	 "limit_s":S*8/(B*1e6),"first_s":…,"p50_s":…,"last_s":…,"time_ratio":last_s/limit_s,
//	 "origin_ratio":origin_bytes/S,"naive_last_s":…,"speedup_vs_naive":naive_last_s/last_s,
//	 "tls":true,"congestion_control":…,"agent_cpu_s":…}
//
// congestion_control is the hosts' TCP congestion control (-congestion; by
// default what a new network namespace takes, the machine's default).
// naive_last_s and speedup_vs_naive are null with -naive=false. With
// -origin-limit-mbit L the agents limit the origin, by its name, to L
// Mbit/s for the whole cluster (--origin-limits; every other origin to a
// tenth of it, --origin-limit), and each line adds "origin_limit_mbit" and
// "origin_limit_share", the origin's bytes over last_s as a share of L. With
// -zones Z (zones.go) the hosts are cut into Z zones and each mode runs
// twice, the agents told nothing of zones ("zones_on":false), then given
// --zone ("zones_on":true); both lines add, per zone, "zone_in_ratio",
// the bytes the zone's hosts received from outside it (the origin and
// the other zones' hosts, IP packets counted by iptables) per S, and
// "zone_peer_ratio", those from the other zones' hosts alone. With -slow K
// the first K hosts run at B/4 and the times are the others'; each line
// adds "slow_nodes" (K) and "slow_time_ratio" (the slowest of the K over
// its own S/B).
//
// The agents talk mutual TLS, as the chart sets them up; -tls=off has them
// share over plain HTTP, for what TLS costs (agent_cpu_s: the CPU time all
// agents used over the mode, the victim of churn left out). A fetch that
// fails makes the bench exit non-zero. Everything (namespaces, processes,
// the temporary directory) is removed at the end and on SIGINT or SIGTERM;
// a second signal exits at once, and the next run removes what is left.
//
//	go run ./bench/swarm -quick     # 4 nodes, 64 MiB, 200 Mbit/s: under a minute
//	go run ./bench/swarm            # 8 nodes, 512 MiB, 100 Mbit/s: the figures
//	go run ./bench/swarm -tls=off   # the same over plain HTTP
//	go run ./bench/swarm -zones 2 -size-mib 256 -modes simultaneous -naive=false
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/benchnet"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/testbed"
)

// originPort is the origin's port on the origin host.
const originPort = 8080

// modes are the modes the bench knows, in the order it runs them.
var modes = []string{"simultaneous", "staggered", "churn"}

// options are the bench's flags.
type options struct {
	nodes      int
	sizeMiB    int64
	linkMbit   int
	chunkMiB   int
	modes      []string
	naive      bool
	weightd    string
	agentArgs  string // more flags for every agent
	tls        string // "on": peers talk mutual TLS (as the chart sets them up); "off": plain HTTP
	congestion string // the hosts' TCP congestion control; "": the machine's default
	zones      int    // 0: no zones; else the hosts are cut into this many zones (zones.go)
	slow       int    // agent hosts whose links run at slowFactor of linkMbit
	// originLimitMbit, when set, is the bench origin's limit for the
	// whole cluster (--origin-limits), every other origin's a tenth of it
	// (--origin-limit)
	originLimitMbit float64
}

// result is one line of output.
type result struct {
	Bench          string    `json:"bench"`
	Mode           string    `json:"mode"`
	Nodes          int       `json:"nodes"`
	SizeBytes      int64     `json:"size_bytes"`
	LinkMbit       int       `json:"link_mbit"`
	LimitS         float64   `json:"limit_s"`
	FirstS         float64   `json:"first_s"`
	P50S           float64   `json:"p50_s"`
	LastS          float64   `json:"last_s"`
	TimeRatio      float64   `json:"time_ratio"`
	OriginRatio    float64   `json:"origin_ratio"`
	NaiveLastS     *float64  `json:"naive_last_s"`
	SpeedupVsNaive *float64  `json:"speedup_vs_naive"`
	TLS            bool      `json:"tls"`
	Congestion     string    `json:"congestion_control"`
	AgentCPUS      float64   `json:"agent_cpu_s"`
	ZonesOn        *bool     `json:"zones_on,omitempty"`
	ZoneInRatio    []float64 `json:"zone_in_ratio,omitempty"`
	ZonePeerRatio  []float64 `json:"zone_peer_ratio,omitempty"`
	// With -origin-limit-mbit: the limit, and the origin's mean rate
	// over the mode (its bytes over last_s) as a share of it.
	OriginLimitMbit  float64 `json:"origin_limit_mbit,omitempty"`
	OriginLimitShare float64 `json:"origin_limit_share,omitempty"`
	// With -slow: how many hosts are slow, and the last one's time over its own link's S/B.
	SlowNodes     int     `json:"slow_nodes,omitempty"`
	SlowTimeRatio float64 `json:"slow_time_ratio,omitempty"`
}

// slowFactor is a slow host's link (-slow) as a share of -link-mbit.
const slowFactor = 4

func main() {
	var (
		o        options
		modeList string
		quick    bool
		// The programs the bench runs inside the testbed's hosts.
		serveDir, listen, control string
		downloadURL, sha          string
		size                      int64
		timeout                   time.Duration
	)
	flag.IntVar(&o.nodes, "nodes", 8, "agent hosts")
	flag.Int64Var(&o.sizeMiB, "size-mib", 512, "blob size in MiB")
	flag.IntVar(&o.linkMbit, "link-mbit", 100, "every host's link, each direction, in Mbit/s")
	flag.IntVar(&o.chunkMiB, "chunk-mib", 2, "the agents' chunk size in MiB (2 MiB crosses a 100 Mbit/s hop in a sixth of a second, so a chunk passes through the swarm quickly; 16 MiB, the agent's default for fast links, pipelines coarsely here)")
	flag.StringVar(&modeList, "modes", strings.Join(modes, ","), "comma-separated modes to run: "+strings.Join(modes, ", "))
	flag.BoolVar(&o.naive, "naive", true, "measure the naive baseline (every host downloads from the origin)")
	flag.StringVar(&o.weightd, "weightd", "", "weightd binary (default: go build ./cmd/weightd into the temporary directory)")
	flag.StringVar(&o.agentArgs, "agent-args", "", "more flags for every agent, space-separated (tuning experiments)")
	flag.StringVar(&o.congestion, "congestion", "", "the hosts' TCP congestion control (cubic, bbr, reno: what the kernel offers); empty: what a new network namespace takes, the machine's default (bench/linkfloor)")
	flag.StringVar(&o.tls, "tls", "on", "on: the agents talk mutual TLS with a CA of the bench's, as the chart sets them up; off: plain HTTP (--peer-insecure), to measure what TLS costs")
	flag.Float64Var(&o.originLimitMbit, "origin-limit-mbit", 0, "limit the origin to this many Mbit/s for the whole cluster, by its name (--origin-limits), every other origin to a tenth of it (--origin-limit); 0 for no limit")
	flag.IntVar(&o.slow, "slow", 0, "run the first K agent hosts' links at a quarter of -link-mbit (a slow tail); time_ratio is then the others'")
	flag.IntVar(&o.zones, "zones", 0, "cut the hosts into this many zones, run each mode without and with --zone, and count the bytes each zone receives from outside it (needs iptables); 0 for none")
	flag.BoolVar(&quick, "quick", false, "a run of under a minute: 4 nodes, 64 MiB, 200 Mbit/s unless set otherwise")
	flag.StringVar(&serveDir, "serve-origin", "", "internal: serve this directory as the origin (in the origin host)")
	flag.StringVar(&listen, "listen", "", "internal: the origin's address")
	flag.StringVar(&control, "control", "", "internal: the origin's control socket")
	flag.StringVar(&downloadURL, "download", "", "internal: download this URL as the naive baseline (in an agent host)")
	flag.StringVar(&sha, "sha256", "", "internal: the download's expected sha256")
	flag.Int64Var(&size, "size", 0, "internal: the download's expected size in bytes")
	flag.DurationVar(&timeout, "timeout", 0, "internal: the download's time limit")
	flag.Parse()
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("bench/swarm: ")

	var err error
	switch {
	case serveDir != "":
		err = benchnet.ServeOrigin(serveDir, listen, control)
	case downloadURL != "":
		err = download(downloadURL, sha, size, timeout)
	default:
		if quick {
			err = benchnet.QuickDefaults(map[string]string{"nodes": "4", "size-mib": "64", "link-mbit": "200"})
		}
		if err == nil {
			o.modes = strings.Split(modeList, ",")
			err = benchnet.RunInterruptible(func(ctx context.Context) error { return run(ctx, o) })
		}
	}
	if err != nil {
		log.Print(err)
		os.Exit(1)
	}
}

func (o options) validate() error {
	switch {
	case o.nodes < 1 || o.nodes > testbed.MaxHosts-1:
		return fmt.Errorf("-nodes %d: want 1 to %d", o.nodes, testbed.MaxHosts-1)
	case o.sizeMiB < 1:
		return fmt.Errorf("-size-mib %d: want at least 1", o.sizeMiB)
	case o.linkMbit < 1:
		return fmt.Errorf("-link-mbit %d: want at least 1", o.linkMbit)
	case o.chunkMiB < 1:
		return fmt.Errorf("-chunk-mib %d: want at least 1", o.chunkMiB)
	case o.tls != "on" && o.tls != "off":
		return fmt.Errorf("-tls %q: want on or off", o.tls)
	case o.slow < 0 || o.slow >= o.nodes-1:
		return fmt.Errorf("-slow %d: want 0 to -nodes - 2 (the churn victim, the last host, is not slow)", o.slow)
	case o.zones != 0 && (o.zones < 2 || o.zones > o.nodes):
		return fmt.Errorf("-zones %d: want 0, or 2 to -nodes", o.zones)
	}
	for _, m := range o.modes {
		if !slices.Contains(modes, m) {
			return fmt.Errorf("-modes: unknown mode %q (want %s)", m, strings.Join(modes, ", "))
		}
		if m == "churn" && o.nodes < 2 {
			return errors.New("-modes churn needs at least 2 nodes: one to kill, one to survive")
		}
	}
	return nil
}

// bench is what every phase of a run shares.
type bench struct {
	options
	work     string // the temporary directory
	exe      string // this program, to re-execute in the hosts
	size     int64
	file     genmodel.File
	url      string // the blob on the origin
	origin   netip.Addr
	control  string // the origin's control socket
	hosts    []*testbed.Host
	limit    time.Duration // S/B
	deadline time.Duration // the most a phase may take
}

// run builds the testbed, the origin and, unless given, weightd, measures
// the naive baseline and then each mode, printing a line per mode, and
// tears everything down.
func run(ctx context.Context, o options) error {
	if err := o.validate(); err != nil {
		return err
	}
	if err := testbed.Available(); err != nil {
		return fmt.Errorf("the swarm bench runs on the namespace testbed: %w", err)
	}
	b := &bench{options: o, size: o.sizeMiB << 20}
	b.limit = time.Duration(float64(b.size) * 8 / (float64(o.linkMbit) * 1e6) * float64(time.Second))
	// Without sharing every agent pulls from the one origin: N·S/B, plus a
	// second per node for staggered starts, with room to spare.
	b.deadline = 3*time.Duration(o.nodes)*b.limit + time.Duration(o.nodes)*time.Second + 2*time.Minute
	var err error
	if b.exe, err = os.Executable(); err != nil {
		return err
	}
	if b.work, err = os.MkdirTemp("", "weightd-bench-swarm-"); err != nil {
		return err
	}
	defer os.RemoveAll(b.work)

	if b.weightd == "" {
		b.weightd = filepath.Join(b.work, "weightd")
		log.Print("building weightd")
		if out, err := exec.CommandContext(ctx, "go", "build", "-o", b.weightd, "./cmd/weightd").CombinedOutput(); err != nil {
			return fmt.Errorf("building weightd (run from the repository root, or pass -weightd): %w\n%s", err, out)
		}
	}

	originDir := filepath.Join(b.work, "origin")
	m, err := genmodel.Generate(originDir, genmodel.Spec{Name: "bench/swarm", Files: 1, TotalBytes: b.size, Seed: 1})
	if err != nil {
		return err
	}
	b.file = m.Files[0]

	start := time.Now()
	tb, err := testbed.New(ctx, testbed.Config{Name: fmt.Sprintf("swarm-%d", os.Getpid()), Hosts: o.nodes + 1, LinkMbit: o.linkMbit, Congestion: o.congestion})
	if err != nil {
		return err
	}
	defer func() {
		if err := tb.Close(); err != nil {
			log.Print(err)
		}
	}()
	all := tb.Hosts()
	b.hosts, b.congestion = all[1:], tb.Congestion()
	for _, h := range b.hosts[:o.slow] {
		if err := tb.SetLink(h, o.linkMbit/slowFactor); err != nil {
			return err
		}
	}
	log.Printf("testbed %s: origin and %d hosts at %d Mbit/s up in %v; blob of %d MiB, limit S/B = %.2fs",
		tb.Name(), o.nodes, o.linkMbit, time.Since(start).Round(time.Millisecond), o.sizeMiB, b.limit.Seconds())

	b.origin = all[0].Addr
	if b.zones > 0 {
		if err := b.countZones(ctx); err != nil {
			return err
		}
	}
	addr := netip.AddrPortFrom(all[0].Addr, originPort)
	b.url = "http://" + addr.String() + "/" + b.file.Path
	b.control = filepath.Join(b.work, "origin.sock")
	stopOrigin, err := benchnet.StartOrigin(ctx, all[0], b.exe, originDir, addr.String(), b.control)
	if err != nil {
		return err
	}
	defer stopOrigin()

	var naive *float64
	if o.naive {
		d, err := b.runNaive(ctx)
		if err != nil {
			return fmt.Errorf("naive baseline: %w", err)
		}
		naive = ptr(benchfig.Round(d.Seconds(), 3))
	}
	zoned := []bool{false}
	if b.zones > 0 {
		zoned = append(zoned, true)
	}
	for _, mode := range o.modes {
		for _, z := range zoned {
			r, err := b.runMode(ctx, mode, z)
			if err != nil {
				return fmt.Errorf("mode %s: %w", mode, err)
			}
			if naive != nil {
				r.NaiveLastS = naive
				r.SpeedupVsNaive = ptr(benchfig.Round(*naive/r.LastS, 3))
			}
			if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
				return err
			}
		}
	}
	return nil
}

// runNaive has every agent host download the blob from the origin at the
// same moment, and returns when the last one finished.
func (b *bench) runNaive(ctx context.Context) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, b.deadline)
	defer cancel()
	before, err := benchnet.OriginBytes(ctx, b.control)
	if err != nil {
		return 0, err
	}
	type proc struct {
		cmd   *exec.Cmd
		start func() error // closes its stdin: the signal to start
	}
	var procs []proc
	defer func() {
		for _, p := range procs {
			_ = p.cmd.Process.Kill() // on the way out after a failure: only reaping matters
			_ = p.cmd.Wait()
		}
	}()
	for _, h := range b.hosts {
		cmd := h.Command(ctx, b.exe, "-download", b.url, "-sha256", b.file.SHA256,
			"-size", fmt.Sprint(b.size), "-timeout", b.deadline.String())
		cmd.Stderr = &benchnet.LineWriter{Prefix: h.Name + " (naive): ", W: os.Stderr}
		stdin, err := cmd.StdinPipe()
		if err != nil {
			return 0, err
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return 0, err
		}
		if err := cmd.Start(); err != nil {
			return 0, err
		}
		procs = append(procs, proc{cmd: cmd, start: stdin.Close})
		ready := make([]byte, len("ready\n"))
		if _, err := io.ReadFull(stdout, ready); err != nil || string(ready) != "ready\n" {
			return 0, fmt.Errorf("downloader in %s did not start: %q, %v", h.Name, ready, err)
		}
	}
	start := time.Now()
	for _, p := range procs {
		if err := p.start(); err != nil {
			return 0, err
		}
	}
	took := make([]time.Duration, len(procs))
	errs := make([]error, len(procs))
	done := make(chan int, len(procs))
	for i, p := range procs {
		go func() {
			if err := p.cmd.Wait(); err != nil {
				errs[i] = fmt.Errorf("%s: %w", b.hosts[i].Name, err)
			}
			took[i] = time.Since(start)
			done <- i
		}()
	}
	for range procs {
		<-done
	}
	procs = nil // all waited for
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	after, err := benchnet.OriginBytes(ctx, b.control)
	if err != nil {
		return 0, err
	}
	last := slices.Max(took)
	log.Printf("naive: %d hosts each downloaded from the origin: last %.2fs (%.2f × S/B), origin sent %.2f × S",
		len(b.hosts), last.Seconds(), last.Seconds()/b.limit.Seconds(), float64(after-before)/float64(b.size))
	return last, nil
}

// runMode runs one mode with fresh agents and caches, given --zone when
// zoned, and returns its line.
func (b *bench) runMode(ctx context.Context, mode string, zoned bool) (result, error) {
	ctx, cancel := context.WithTimeout(ctx, b.deadline)
	defer cancel()
	dir := filepath.Join(b.work, mode)
	if zoned {
		dir += "-zones"
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		return result{}, err
	}
	defer os.RemoveAll(dir)
	syscall.Sync() // the previous phase's write-back must not slow this one

	cfg := benchnet.AgentConfig{Bin: b.weightd, Dir: dir, ChunkMiB: b.chunkMiB,
		Extra: append(strings.Fields(b.agentArgs), b.originLimitFlags()...), PlainPeers: b.tls == "off"}
	if zoned {
		cfg.HostExtra = func(h *testbed.Host) []string { return b.zoneFlag(slices.Index(b.hosts, h)) }
	}
	agents, err := benchnet.StartAgents(ctx, b.hosts, cfg)
	if err != nil {
		return result{}, err
	}
	defer agents.Close()
	before, err := benchnet.OriginBytes(ctx, b.control)
	if err != nil {
		return result{}, err
	}
	var zones0 zoneBytes
	if b.zones > 0 {
		if zones0, err = b.readZones(ctx); err != nil {
			return result{}, err
		}
	}

	n := len(agents.List)
	delays := make([]time.Duration, n)
	victim := -1
	switch mode {
	case "staggered":
		for i := range delays {
			delays[i] = time.Duration(i) * time.Second
		}
	case "churn":
		victim = n - 1
	}
	cpu0, err := benchnet.SampleCPU(agents.List, -1)
	if err != nil {
		return result{}, err
	}
	took, err := fetchAll(ctx, agents.List, b.url+"#sha256:"+b.file.SHA256, delays, victim, b.size/2)
	if err != nil {
		if ctx.Err() == context.DeadlineExceeded {
			err = fmt.Errorf("%w (not done after %v)", err, b.deadline)
		}
		return result{}, err
	}
	cpu1, err := benchnet.SampleCPU(agents.List, victim)
	if err != nil {
		return result{}, err
	}
	after, err := benchnet.OriginBytes(ctx, b.control)
	if err != nil {
		return result{}, err
	}

	var secs []float64
	slowLast := 0.0
	for i, d := range took {
		switch {
		case i < b.slow:
			slowLast = max(slowLast, d.Seconds())
		case i != victim:
			secs = append(secs, d.Seconds())
		}
	}
	slices.Sort(secs)
	limit := b.limit.Seconds()
	r := result{
		Bench: "swarm", Mode: mode, Nodes: n, SizeBytes: b.size, LinkMbit: b.linkMbit,
		LimitS:      benchfig.Round(limit, 3),
		FirstS:      benchfig.Round(secs[0], 3),
		P50S:        benchfig.Round(benchfig.Median(secs), 3),
		LastS:       benchfig.Round(secs[len(secs)-1], 3),
		TimeRatio:   benchfig.Round(secs[len(secs)-1]/limit, 3),
		OriginRatio: benchfig.Round(float64(after-before)/float64(b.size), 3),
		TLS:         b.tls == "on",
		Congestion:  b.congestion,
		AgentCPUS:   benchfig.Round(cpu1.AgentSeconds(cpu0, victim), 3),
	}
	if b.slow > 0 {
		r.SlowNodes, r.SlowTimeRatio = b.slow, benchfig.Round(slowLast/limit/slowFactor, 3)
	}
	if b.originLimitMbit > 0 {
		r.OriginLimitMbit = b.originLimitMbit
		r.OriginLimitShare = benchfig.Round(float64(after-before)*8/1e6/secs[len(secs)-1]/b.originLimitMbit, 3)
		log.Printf("%s: the origin sent at %.0f%% of its limit of %g Mbit/s", mode, 100*r.OriginLimitShare, b.originLimitMbit)
	}
	if b.zones > 0 {
		zones, err := b.readZones(ctx)
		if err != nil {
			return result{}, err
		}
		r.ZonesOn = &zoned
		r.ZoneInRatio, r.ZonePeerRatio = zones.ratios(zones0, b.size)
		log.Printf("%s (zones on: %v): bytes into each zone from outside it %v × S, from other zones' hosts %v × S", mode, zoned, r.ZoneInRatio, r.ZonePeerRatio)
	}
	log.Printf("%s: %s; origin sent %.2f × S", mode, describe(agents.List, took, victim), r.OriginRatio)
	log.Printf("%s: %s", mode, describeCPU(cpu0, cpu1, victim))
	return r, nil
}

// originLimitFlags are the agents' flags for -origin-limit-mbit: the
// origin named by its host and port, as an http(s) origin is.
func (b *bench) originLimitFlags() []string {
	if b.originLimitMbit <= 0 {
		return nil
	}
	u, err := url.Parse(b.url)
	if err != nil {
		panic(err) // built by run
	}
	limit := int64(b.originLimitMbit * 1e6 / 8)
	return []string{"--origin-limit", strconv.FormatInt(limit/10, 10), "--origin-limits", u.Host + "=" + strconv.FormatInt(limit, 10)}
}

// describeCPU says how busy the CPUs were from s0 to s, leaving out agent
// skip (the machine's figure includes whatever else runs on it).
func describeCPU(s0, s benchnet.CPUSample, skip int) string {
	wall, cores := s.Since(s0), float64(runtime.NumCPU())
	agents := s.AgentSeconds(s0, skip)
	return fmt.Sprintf("over %.1fs the agents used %.1f CPU-seconds (%.0f%% of %d cores), the machine was %.0f%% busy",
		wall.Seconds(), agents, 100*agents/wall.Seconds()/cores, int(cores), 100*s.Busy(s0))
}

// describe lists each agent's time, for the log.
func describe(agents []*benchnet.Agent, took []time.Duration, victim int) string {
	var parts []string
	for i, a := range agents {
		if i == victim {
			parts = append(parts, a.Node+" killed")
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %.2fs", a.Node, took[i].Seconds()))
	}
	return strings.Join(parts, ", ")
}

func ptr(f float64) *float64 { return &f }
