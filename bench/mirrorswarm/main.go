// Command mirrorswarm measures containerd pulling one image through each
// node's weightd registry mirror, N nodes at once, as a ratio to S/B (one
// node's link) and beside every node pulling from the registry.
//
// The testbed (internal/testbed: network namespaces, so root and iproute2)
// has a registry host and N nodes, every link shaped to B. The registry
// host runs Debian's docker-registry behind a proxy that counts blob bytes
// by User-Agent, containerd's or weightd's (benchnet.ServeRegistry). An
// image of S bytes in L layers of random data is pushed over the registry
// host's loopback, uncounted. Each node runs, inside its namespace, a
// containerd 2.x (services.BuildContainerd) and, in the mirror modes, a
// `weightd agent` whose mirror writes that containerd's hosts.toml. Every
// mode starts with empty caches and content stores.
//
// -client ctr pulls with `ctr content fetch --hosts-dir` in the node;
// -client cri with the CRI's PullImage, which also unpacks. A node's time
// runs from its pull's start to its end, and the node's content store must
// then hold every blob of the image. The modes:
//
//   - nomirror: every node pulls from the registry alone;
//   - agents: the agents fetch the image through their API, containerd
//     left out: the swarm's own figure in the same run;
//   - simultaneous: all N pull through their mirrors at once; halfway
//     through, the first node's mirror is asked for a small blob no node
//     holds (small_blob_ms), then for the manifest by tag of an image no
//     node pulled (small_manifest_ms), beside a TCP connect to the
//     registry (rtt_ms);
//   - rolling: one node pulls alone, then the other N-1 at once; the
//     figures are over those N-1 (first_node_s is the lone pull);
//   - agents-rolling: the same through the agents' API, containerd left
//     out;
//   - killed: all N at once, and the last node's agent is killed (SIGKILL)
//     once that node's containerd holds half the image; its containerd
//     must finish through the registry (killed_node_s, and
//     killed_node_ratio against nomirror's last_s when nomirror ran first).
//
// Each mode prints one JSON line on stdout (logs go to stderr):
//
//	{"bench":"mirror-swarm","mode":…,"client":…,"nodes":N,"size_bytes":S,"layers":L,
//	 "link_mbit":B,"limit_s":S*8/(B*1e6),"first_s":…,"p50_s":…,"last_s":…,
//	 "time_ratio":last_s/limit_s,"origin_ratio":registry_blob_bytes/S,
//	 "registry_bytes_by_client":{"containerd":…,"weightd":…,"other":…},
//	 "registry_by_node":{"h1":{"containerd":{"blob_gets":…,"blob_bytes":…},…},…},
//	 "node_s":{"h1":…,…},"nomirror_last_s":…,"speedup_vs_nomirror":…,"cpu_busy":…,
//	 "congestion_control":…,"held_last_s":…,"held_time_ratio":…}
//
// S counts what a pull transfers (manifest, config, compressed layers);
// held_last_s is when the last node's content store first held S bytes
// (containerd's pulls only), before a CRI pull's last unpacks;
// congestion_control is the hosts' TCP congestion control (-congestion;
// by default what a new network namespace takes, the machine's default);
// cpu_busy is the machine's busy share of its CPUs over the mode, and
// agent_cpu_s (where agents run) the CPU seconds, user and system, the
// agents used over it together, a killed one left out (as bench/swarm's).
// Everything is torn down at the end and on SIGINT or SIGTERM; a second
// signal exits at once, and the next run removes what is left.
//
//	go run ./bench/mirrorswarm -quick   # 4 nodes, 64 MiB, 200 Mbit/s
//	go run ./bench/mirrorswarm          # 8 nodes, 512 MiB in 4 layers, 100 Mbit/s
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/benchnet"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/internal/testbed"
)

// registryPort is the registry's port on the registry host.
const registryPort = 5000

// modes are the modes the bench knows, in the order it runs them.
var modes = []string{"nomirror", "agents", "simultaneous", "rolling", "agents-rolling", "killed"}

// clients are the ways a node pulls.
var clients = []string{"ctr", "cri"}

// options are the bench's flags.
type options struct {
	nodes      int
	sizeMiB    int64
	layers     int
	linkMbit   int
	chunkMiB   int
	modes      []string
	client     string
	weightd    string
	agentArgs  string // more flags for every agent
	congestion string // the hosts' TCP congestion control; "": the machine's default
}

// result is one line of output.
type result struct {
	Bench                 string                                 `json:"bench"`
	Mode                  string                                 `json:"mode"`
	Client                string                                 `json:"client"`
	Nodes                 int                                    `json:"nodes"`
	SizeBytes             int64                                  `json:"size_bytes"`
	Layers                int                                    `json:"layers"`
	LinkMbit              int                                    `json:"link_mbit"`
	LimitS                float64                                `json:"limit_s"`
	FirstS                float64                                `json:"first_s"`
	P50S                  float64                                `json:"p50_s"`
	LastS                 float64                                `json:"last_s"`
	TimeRatio             float64                                `json:"time_ratio"`
	OriginRatio           float64                                `json:"origin_ratio"`
	RegistryBytesByClient map[string]int64                       `json:"registry_bytes_by_client"`
	RegistryByNode        map[string]map[string]benchnet.Traffic `json:"registry_by_node"`
	NodeS                 map[string]float64                     `json:"node_s"`
	NomirrorLastS         *float64                               `json:"nomirror_last_s"`
	SpeedupVsNomirror     *float64                               `json:"speedup_vs_nomirror"`
	FirstNodeS            *float64                               `json:"first_node_s,omitempty"`
	KilledNodeS           *float64                               `json:"killed_node_s,omitempty"`
	KilledNodeRatio       *float64                               `json:"killed_node_ratio,omitempty"`
	CPUBusy               float64                                `json:"cpu_busy"`
	Congestion            string                                 `json:"congestion_control"`
	AgentCPUS             *float64                               `json:"agent_cpu_s,omitempty"`
	SmallBlobMS           *float64                               `json:"small_blob_ms,omitempty"`
	SmallManifestMS       *float64                               `json:"small_manifest_ms,omitempty"`
	RTTMS                 *float64                               `json:"rtt_ms,omitempty"`
	HeldLastS             *float64                               `json:"held_last_s,omitempty"`
	HeldTimeRatio         *float64                               `json:"held_time_ratio,omitempty"`
}

func main() {
	var (
		o        options
		modeList string
		quick    bool
		// The registry, which the bench runs inside the registry host.
		serveRegistry, listen, control    string
		probeURL, probeManifest, probeRTT string
	)
	flag.IntVar(&o.nodes, "nodes", 8, "nodes (hosts with a containerd and, in the mirror modes, an agent)")
	flag.Int64Var(&o.sizeMiB, "size-mib", 512, "image size in MiB (random data, split evenly over the layers)")
	flag.IntVar(&o.layers, "layers", 4, "image layers")
	flag.IntVar(&o.linkMbit, "link-mbit", 100, "every host's link, each direction, in Mbit/s")
	flag.IntVar(&o.chunkMiB, "chunk-mib", 2, "the agents' chunk size in MiB (as bench/swarm: 2 MiB crosses a 100 Mbit/s hop in a sixth of a second)")
	flag.StringVar(&modeList, "modes", strings.Join(modes, ","), "comma-separated modes to run: "+strings.Join(modes, ", "))
	flag.StringVar(&o.client, "client", "ctr", "how a node pulls: ctr (ctr content fetch in the node) or cri (the CRI's PullImage: the daemon pulls and unpacks)")
	flag.StringVar(&o.weightd, "weightd", "", "weightd binary (default: go build ./cmd/weightd into the temporary directory)")
	flag.StringVar(&o.agentArgs, "agent-args", "", "more flags for every agent, space-separated (tuning experiments)")
	flag.StringVar(&o.congestion, "congestion", "", "the hosts' TCP congestion control (cubic, bbr, reno: what the kernel offers); empty: what a new network namespace takes, the machine's default (bench/linkfloor)")
	flag.BoolVar(&quick, "quick", false, "a short run: 4 nodes, 64 MiB, 200 Mbit/s unless set otherwise")
	flag.StringVar(&serveRegistry, "serve-registry", "", "internal: run the registry with its storage in this directory (in the registry host)")
	flag.StringVar(&listen, "listen", "", "internal: the registry's address")
	flag.StringVar(&control, "control", "", "internal: the registry's control socket")
	flag.StringVar(&probeURL, "probe-url", "", "internal: time a GET of this small blob (in a node)")
	flag.StringVar(&probeManifest, "probe-manifest-url", "", "internal: then time a GET of this manifest by tag (in a node)")
	flag.StringVar(&probeRTT, "probe-rtt", "", "internal: time a TCP connect to this address first, the round trip (in a node)")
	flag.Parse()
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("bench/mirrorswarm: ")

	var err error
	if serveRegistry != "" {
		err = benchnet.ServeRegistry(serveRegistry, listen, control)
	} else if probeURL != "" {
		err = probe(probeURL, probeManifest, probeRTT)
	} else {
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
	case o.layers < 1 || int64(o.layers) > o.sizeMiB<<20:
		return fmt.Errorf("-layers %d: want 1 to the image's bytes", o.layers)
	case o.linkMbit < 1:
		return fmt.Errorf("-link-mbit %d: want at least 1", o.linkMbit)
	case o.chunkMiB < 1:
		return fmt.Errorf("-chunk-mib %d: want at least 1", o.chunkMiB)
	case !slices.Contains(clients, o.client):
		return fmt.Errorf("-client %q: want %s", o.client, strings.Join(clients, " or "))
	}
	for _, m := range o.modes {
		if !slices.Contains(modes, m) {
			return fmt.Errorf("-modes: unknown mode %q (want %s)", m, strings.Join(modes, ", "))
		}
		if (m == "rolling" || m == "agents-rolling" || m == "killed") && o.nodes < 2 {
			return fmt.Errorf("-modes %s needs at least 2 nodes", m)
		}
	}
	return nil
}

// bench is what every mode of a run shares.
type bench struct {
	options
	work     string // the temporary directory
	bins     services.ContainerdBinaries
	reg      *benchnet.Registry
	img      benchnet.Image
	small    benchnet.Image  // a one-layer image of a few hundred bytes, its layer asked for mid-pull
	tagged   benchnet.Image  // another, its manifest asked for by tag mid-pull
	hosts    []*testbed.Host // the nodes' hosts
	size     int64           // S: what a pull transfers
	limit    time.Duration   // S/B
	deadline time.Duration   // the most a mode may take
	nomirror *float64        // nomirror's last_s, once measured
}

// run builds containerd, weightd, the testbed and the registry, pushes the
// image, then runs each mode, printing a line per mode, and tears everything
// down.
func run(ctx context.Context, o options) error {
	if err := o.validate(); err != nil {
		return err
	}
	if err := testbed.Available(); err != nil {
		return fmt.Errorf("the mirror swarm bench runs on the namespace testbed: %w", err)
	}
	if err := services.RegistryAvailable(); err != nil {
		return err
	}
	b := &bench{options: o}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	if b.work, err = os.MkdirTemp("", "weightd-bench-mirrorswarm-"); err != nil {
		return err
	}
	defer os.RemoveAll(b.work)

	dir, err := services.ContainerdCacheDir(services.Containerd2Version)
	if err != nil {
		return err
	}
	log.Printf("containerd %s: building into %s unless it is there (about 3 minutes the first time)", services.Containerd2Version, dir)
	if b.bins, err = services.BuildContainerd(ctx, services.Containerd2Version); err != nil {
		return err
	}
	if b.weightd == "" {
		b.weightd = filepath.Join(b.work, "weightd")
		log.Print("building weightd")
		if out, err := exec.CommandContext(ctx, "go", "build", "-o", b.weightd, "./cmd/weightd").CombinedOutput(); err != nil {
			return fmt.Errorf("building weightd (run from the repository root, or pass -weightd): %w\n%s", err, out)
		}
	}

	start := time.Now()
	tb, err := testbed.New(ctx, testbed.Config{Name: fmt.Sprintf("mswarm-%d", os.Getpid()), Hosts: o.nodes + 1, LinkMbit: o.linkMbit, Congestion: o.congestion})
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
	log.Printf("testbed %s: registry and %d nodes at %d Mbit/s up in %v",
		tb.Name(), o.nodes, o.linkMbit, time.Since(start).Round(time.Millisecond))

	addr := netip.AddrPortFrom(all[0].Addr, registryPort).String()
	if b.reg, err = benchnet.StartRegistry(ctx, all[0], exe, filepath.Join(b.work, "registry"), addr, filepath.Join(b.work, "registry.sock")); err != nil {
		return err
	}
	defer b.reg.Close()
	start = time.Now()
	if b.img, err = b.reg.Push(ctx, "bench/mirrorswarm", "v1", o.layers, (o.sizeMiB<<20)/int64(o.layers)); err != nil {
		return err
	}
	if b.small, err = b.reg.Push(ctx, "bench/small", "v1", 1, 512); err != nil {
		return err
	}
	if b.tagged, err = b.reg.Push(ctx, "bench/tagged", "v1", 1, 512); err != nil {
		return err
	}
	b.size = b.img.Size()
	b.limit = time.Duration(float64(b.size) * 8 / (float64(o.linkMbit) * 1e6) * float64(time.Second))
	// Without sharing every node pulls from the one registry: N·S/B, with
	// room to spare, twice over for rolling.
	b.deadline = 3*time.Duration(o.nodes)*b.limit + 2*time.Minute
	log.Printf("pushed %s in %v: %d bytes in %d layers; limit S/B = %.2fs",
		b.img.Ref, time.Since(start).Round(time.Millisecond), b.size, len(b.img.Layers), b.limit.Seconds())

	for _, mode := range o.modes {
		r, err := b.runMode(ctx, mode)
		if err != nil {
			return fmt.Errorf("mode %s: %w", mode, err)
		}
		if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
			return err
		}
	}
	return nil
}

// runMode runs one mode on fresh nodes and returns its line.
func (b *bench) runMode(ctx context.Context, mode string) (result, error) {
	ctx, cancel := context.WithTimeout(ctx, b.deadline)
	defer cancel()
	dir := filepath.Join(b.work, mode)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return result{}, err
	}
	defer os.RemoveAll(dir)
	syscall.Sync() // the previous mode's write-back must not slow this one

	nodes, err := b.startNodes(ctx, dir)
	if err != nil {
		return result{}, err
	}
	defer closeNodes(nodes)
	var agents *benchnet.Agents
	if mode == "nomirror" {
		for _, n := range nodes {
			if err := n.writeRegistryHosts(b.reg.Addr); err != nil {
				return result{}, err
			}
		}
	} else {
		if agents, err = b.startAgents(ctx, dir, nodes); err != nil {
			return result{}, err
		}
		defer agents.Close()
	}

	before, err := b.reg.Traffic(ctx)
	if err != nil {
		return result{}, err
	}
	var list []*benchnet.Agent
	if agents != nil {
		list = agents.List
	}
	cpu0, err := benchnet.SampleCPU(list, -1)
	if err != nil {
		return result{}, err
	}
	var (
		res     pulls
		over    []int // the nodes the figures are over
		lone    pulls
		victim  = -1
		errPull error
		small   probeResult
	)
	all := make([]int, len(nodes))
	for i := range all {
		all[i] = i
	}
	switch mode {
	case "nomirror":
		res, errPull = b.pullAll(ctx, nodes, all, nil)
		over = all
	case "simultaneous":
		probed := make(chan probeResult, 1)
		go func() { probed <- b.probeSmallBlob(ctx, nodes[0]) }()
		res, errPull = b.pullAll(ctx, nodes, all, nil)
		over = all
		small = <-probed
	case "agents":
		res, errPull = b.fetchAll(ctx, agents, all)
		over = all
	case "rolling", "agents-rolling":
		pull := func(which []int) (pulls, error) { return b.pullAll(ctx, nodes, which, nil) }
		if mode == "agents-rolling" {
			pull = func(which []int) (pulls, error) { return b.fetchAll(ctx, agents, which) }
		}
		lone, errPull = pull(all[:1])
		if errPull == nil {
			log.Printf("%s: %s pulled alone in %.2fs", mode, nodes[0].host.Name, lone.took[0].Seconds())
			res, errPull = pull(all[1:])
		}
		over = all[1:]
	case "killed":
		victim = len(nodes) - 1
		res, errPull = b.pullAll(ctx, nodes, all, &killer{node: nodes[victim], agent: agents.List[victim], at: b.size / 2})
		over = all
	}
	if errPull != nil {
		if ctx.Err() == context.DeadlineExceeded {
			errPull = fmt.Errorf("%w (not done after %v)", errPull, b.deadline)
		}
		return result{}, errPull
	}
	took := res.took
	if lone.took != nil {
		took[0] = lone.took[0]
	}
	cpu1, err := benchnet.SampleCPU(list, victim)
	if err != nil {
		return result{}, err
	}
	busy := cpu1.Busy(cpu0)
	for _, n := range nodes {
		if strings.HasPrefix(mode, "agents") {
			break // containerd was left out
		}
		if err := n.verify(ctx, b.client, b.img); err != nil {
			return result{}, err
		}
	}
	after, err := b.reg.Traffic(ctx)
	if err != nil {
		return result{}, err
	}
	r := b.result(mode, nodes, took, over, after.Sub(before))
	if res.held != nil {
		var last time.Duration
		for _, i := range over {
			last = max(last, res.held[i])
		}
		r.HeldLastS, r.HeldTimeRatio = ptr(benchfig.Round(last.Seconds(), 3)), ptr(benchfig.Round(last.Seconds()/b.limit.Seconds(), 3))
	}
	r.CPUBusy, r.Congestion = benchfig.Round(busy, 3), b.congestion
	if agents != nil {
		r.AgentCPUS = ptr(benchfig.Round(cpu1.AgentSeconds(cpu0, victim), 3))
	}
	if small.err != nil {
		return result{}, fmt.Errorf("asking for a small blob mid-pull: %w", small.err)
	}
	if mode == "simultaneous" {
		r.SmallBlobMS, r.SmallManifestMS, r.RTTMS = ptr(benchfig.Round(small.GetMS, 3)), ptr(benchfig.Round(small.ManifestMS, 3)), ptr(benchfig.Round(small.RTTMS, 3))
	}
	switch mode {
	case "nomirror":
		b.nomirror = ptr(r.LastS)
	case "rolling", "agents-rolling":
		r.FirstNodeS = ptr(benchfig.Round(lone.took[0].Seconds(), 3))
	case "killed":
		r.KilledNodeS = ptr(benchfig.Round(took[victim].Seconds(), 3))
		if b.nomirror != nil {
			r.KilledNodeRatio = ptr(benchfig.Round(took[victim].Seconds() / *b.nomirror, 3))
		}
	}
	if mode != "nomirror" && b.nomirror != nil {
		r.NomirrorLastS = b.nomirror
		r.SpeedupVsNomirror = ptr(benchfig.Round(*b.nomirror/r.LastS, 3))
	}
	log.Printf("%s: %s; registry sent %.2f × S (containerd %.2f, weightd %.2f); the machine was %.0f%% busy", mode, describe(nodes, took, victim), r.OriginRatio,
		float64(r.RegistryBytesByClient[benchnet.ClientContainerd])/float64(b.size),
		float64(r.RegistryBytesByClient[benchnet.ClientWeightd])/float64(b.size), 100*busy)
	return r, nil
}

// result computes a mode's line from each node's time, over the nodes of
// index over, and the registry's traffic during the mode.
func (b *bench) result(mode string, nodes []*node, took []time.Duration, over []int, traffic benchnet.RegistryTraffic) result {
	var secs []float64
	for _, i := range over {
		secs = append(secs, took[i].Seconds())
	}
	slices.Sort(secs)
	limit := b.limit.Seconds()
	r := result{
		Bench: "mirror-swarm", Mode: mode, Client: b.client, Nodes: len(nodes), SizeBytes: b.size, Layers: len(b.img.Layers), LinkMbit: b.linkMbit,
		LimitS:                benchfig.Round(limit, 3),
		FirstS:                benchfig.Round(secs[0], 3),
		P50S:                  benchfig.Round(benchfig.Median(secs), 3),
		LastS:                 benchfig.Round(secs[len(secs)-1], 3),
		TimeRatio:             benchfig.Round(secs[len(secs)-1]/limit, 3),
		RegistryBytesByClient: make(map[string]int64),
		RegistryByNode:        make(map[string]map[string]benchnet.Traffic),
		NodeS:                 make(map[string]float64),
	}
	var total int64
	for c, t := range traffic.ByClient() {
		r.RegistryBytesByClient[c] = t.BlobBytes
		total += t.BlobBytes
	}
	r.OriginRatio = benchfig.Round(float64(total)/float64(b.size), 3)
	for i, n := range nodes {
		r.NodeS[n.host.Name] = benchfig.Round(took[i].Seconds(), 3)
		m := make(map[string]benchnet.Traffic)
		for c, t := range traffic[n.host.Addr.String()] {
			if t.BlobGets > 0 {
				m[c] = t
			}
		}
		r.RegistryByNode[n.host.Name] = m
	}
	return r
}

// startAgents starts an agent with its registry mirror in each node's
// host, and waits until each has written its node's hosts.toml.
func (b *bench) startAgents(ctx context.Context, dir string, nodes []*node) (*benchnet.Agents, error) {
	hostsDir := make(map[*testbed.Host]string, len(nodes))
	for _, n := range nodes {
		hostsDir[n.host] = n.ctd.HostsDir
	}
	extra := append([]string{"--mirror-registries", b.reg.Addr, "--insecure-registries", b.reg.Addr}, strings.Fields(b.agentArgs)...)
	agents, err := benchnet.StartAgents(ctx, b.hosts, benchnet.AgentConfig{
		Bin: b.weightd, Dir: filepath.Join(dir, "agents"), ChunkMiB: b.chunkMiB, Extra: extra,
		HostExtra: func(h *testbed.Host) []string {
			return []string{"--mirror-addr", netip.AddrPortFrom(h.Addr, benchnet.MirrorPort).String(), "--hosts-dir", hostsDir[h]}
		},
	})
	if err != nil {
		return nil, err
	}
	for _, n := range nodes {
		if err := n.waitMirrorHosts(ctx, b.reg.Addr, 10*time.Second); err != nil {
			agents.Close()
			return nil, err
		}
	}
	return agents, nil
}

// describe lists each node's time, for the log.
func describe(nodes []*node, took []time.Duration, victim int) string {
	var parts []string
	for i, n := range nodes {
		s := fmt.Sprintf("%s %.2fs", n.host.Name, took[i].Seconds())
		if i == victim {
			s += " (agent killed)"
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, ", ")
}

func ptr(f float64) *float64 { return &f }
