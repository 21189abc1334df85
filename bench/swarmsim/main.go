// Command swarmsim simulates N weightd nodes filling one blob through the
// swarm (internal/swarmsim): the nodes' decisions are the real swarm code
// (p2p.Planner), the network, chunk servers, membership and origin a
// model. It reaches cluster sizes bench/swarm cannot; bench/swarm's
// figures (8 nodes, 512 MiB, 100 Mbit/s, 2 MiB chunks) check it.
//
// Each run prints one JSON line on stdout, {"bench":"swarm-sim",…}, its
// figures those of swarmsim.Result.
//
//	go run ./bench/swarmsim -nodes 8 -size-mib 512 -chunk-mib 2 -faults=false   # bench/swarm's set-up
//	go run ./bench/swarmsim -nodes 100,1000 -size-mib 1024,16384                 # the issue's
package main

import (
	"encoding/json"
	"flag"
	"log"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/weightd/weightd/internal/swarmsim"
	"github.com/weightd/weightd/pkg/p2p"
)

type line struct {
	Bench               string  `json:"bench"`
	Nodes               int     `json:"nodes"`
	SizeBytes           int64   `json:"size_bytes"`
	ChunkBytes          int64   `json:"chunk_bytes"`
	LinkMbit            float64 `json:"link_mbit"`
	Faults              bool    `json:"faults"`
	Seeders             int     `json:"seeders,omitempty"`
	StreamMBs           float64 `json:"stream_mb_s,omitempty"`
	RefreshMs           float64 `json:"refresh_ms"`
	StepMs              float64 `json:"step_ms"`
	TimeRatioP50        float64 `json:"time_ratio_p50"`
	TimeRatioP99        float64 `json:"time_ratio_p99"`
	SlowTimeRatioP50    float64 `json:"slow_time_ratio_p50,omitempty"`
	FastTimeRatioP99    float64 `json:"fast_time_ratio_p99"`
	TimeRatioMax        float64 `json:"time_ratio_max"`
	OriginRatio         float64 `json:"origin_ratio"`
	SeedRatio           float64 `json:"seed_ratio,omitempty"`
	OriginDoneRatio     float64 `json:"origin_done_ratio"`
	RelayedBytesPerNode float64 `json:"relayed_bytes_per_node"`
	SchedCPUSPerNode    float64 `json:"sched_cpu_s_per_node"`
	StateBytesPerNodeS  float64 `json:"state_bytes_per_node_s"`
	RefusedPerNodeS     float64 `json:"refused_per_node_s"`
	StateReadsPerNodeS  float64 `json:"state_reads_per_node_s"`
	GossipBytesPerNodeS float64 `json:"gossip_bytes_per_node_s"`
	Zones               int     `json:"zones,omitempty"`
	ZonesUntold         bool    `json:"zones_untold,omitempty"`
	ZoneInRatio         float64 `json:"zone_in_ratio,omitempty"`
	Finished            int     `json:"finished"`
	Killed              int     `json:"killed"`
	BannedLiar          int     `json:"banned_liar"`
	BannedHonest        int     `json:"banned_honest"`
	Fetchers            int     `json:"origin_fetchers"`
	SlowFetchers        int     `json:"slow_fetchers"`
	KilledFetchers      int     `json:"killed_fetchers"`
	LyingFetchers       int     `json:"lying_fetchers"`
	RunS                float64 `json:"run_s"`
}

func main() {
	nodes := flag.String("nodes", "100,1000", "comma-separated cluster sizes")
	sizes := flag.String("size-mib", "1024,16384", "comma-separated blob sizes in MiB")
	chunkMiB := flag.Int64("chunk-mib", 16, "chunk size in MiB (the agent's default is 16)")
	linkMbit := flag.Float64("link-mbit", 100, "every node's link, each way, in Mbit/s")
	originMbit := flag.Float64("origin-mbit", 0, "the origin's uplink in Mbit/s (default: -link-mbit)")
	faults := flag.Bool("faults", true, "a 10% slow tail at ¼ speed, 5% of nodes killed mid-fill, 10% starting late, one lying peer")
	only := flag.String("only", "", "with -faults, only these of them, comma-separated: slow, kill, late, liar (to tell their costs apart)")
	refresh := flag.Duration("refresh", 0, "SwarmConfig.Refresh, the least time between two state reads of one holder (default 50ms)")
	step := flag.Duration("step", 0, "the network's time step (default Refresh/2, at most 25ms and an eighth of a chunk's time on the link)")
	maxInFlight := flag.Int("max-inflight", 0, "SwarmConfig.MaxInFlight, requests in flight per blob (default 8)")
	originInFlight := flag.Int("origin-inflight", 0, "SwarmConfig.OriginInFlight, an origin fetcher's origin requests in flight (default: 3, a node's only fill)")
	originFetchers := flag.Int("origin-fetchers", 0, "SwarmConfig.OriginFetchers (default 2)")
	perPeer := flag.Int("per-peer", 0, "SwarmConfig.PerPeer, requests in flight to one peer (default 2)")
	maxFollowed := flag.Int("max-followed", 0, "SwarmConfig.MaxFollowed, holders one download follows (default 24)")
	maxUploads := flag.Int("max-uploads", 0, "a chunk server's uploads at once (default 6, the agent's)")
	seeders := flag.Int("seeders", 0, "nodes that hold the blob from the start (a node that pulled it before); the others fill it")
	streamMBs := flag.Float64("stream-mb-s", 0, "a reader on each filling node takes the blob in order at this many MB/s (the registry mirror's stream to containerd); a node's time is its reader's. 0: none")
	zones := flag.Int("zones", 0, "zones the nodes lie in, each node told its own (0: none); zone_in_ratio is the most that reached one zone from outside it, over S")
	untold := flag.Bool("zones-untold", false, "with -zones, the nodes are not told their zones (the same cluster without zone-aware choice)")
	seed := flag.Uint64("seed", 1, "random seed")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the runs to this file")
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}
	for _, n := range ints(*nodes) {
		for _, mib := range ints(*sizes) {
			cfg := swarmsim.Config{Nodes: n, Size: int64(mib) << 20, ChunkSize: *chunkMiB << 20,
				Link: *linkMbit * 1e6 / 8, OriginLink: *originMbit * 1e6 / 8, Seed: *seed, Step: *step, Seeders: *seeders, StreamRate: *streamMBs * 1e6, Zones: *zones, ZonesUntold: *untold,
				Swarm: p2p.SwarmConfig{Refresh: *refresh, MaxInFlight: *maxInFlight, OriginInFlight: *originInFlight, OriginFetchers: *originFetchers, PerPeer: *perPeer, MaxFollowed: *maxFollowed}, MaxUploads: *maxUploads}
			if *faults {
				cfg.SlowFraction, cfg.KillFraction, cfg.LateFraction, cfg.Liars = 0.1, 0.05, 0.1, 1
				if *only != "" {
					keep := strings.Split(*only, ",")
					for name, f := range map[string]*float64{"slow": &cfg.SlowFraction, "kill": &cfg.KillFraction, "late": &cfg.LateFraction} {
						if !slices.Contains(keep, name) {
							*f = 0
						}
					}
					if !slices.Contains(keep, "liar") {
						cfg.Liars = 0
					}
				}
			}
			start := time.Now()
			r, err := swarmsim.Run(cfg)
			if err != nil {
				log.Print(err)
				return
			}
			out := line{Bench: "swarm-sim", Nodes: n, SizeBytes: cfg.Size, ChunkBytes: cfg.ChunkSize, LinkMbit: *linkMbit,
				Faults: *faults, Seeders: r.Seeders, StreamMBs: *streamMBs, RefreshMs: ms(r.Refresh), StepMs: ms(r.Step),
				TimeRatioP50: r.TimeRatioP50, TimeRatioP99: r.TimeRatioP99, SlowTimeRatioP50: r.SlowTimeRatioP50, FastTimeRatioP99: r.FastTimeRatioP99, TimeRatioMax: r.TimeRatioMax,
				OriginRatio: r.OriginRatio, SeedRatio: r.SeedRatio, OriginDoneRatio: r.OriginDoneRatio, RelayedBytesPerNode: r.RelayedBytesPerNode, SchedCPUSPerNode: r.SchedCPUPerNode,
				StateBytesPerNodeS: r.StateBytesPerNodeS, RefusedPerNodeS: r.RefusedPerNodeS, StateReadsPerNodeS: r.StateReadsPerNodeS, GossipBytesPerNodeS: r.GossipBytesPerNodeS, Zones: *zones, ZonesUntold: *untold, ZoneInRatio: r.ZoneInRatio,
				Finished: r.Finished, Killed: r.Killed, BannedLiar: r.BannedLiar, BannedHonest: r.BannedHonest, Fetchers: r.Fetchers, SlowFetchers: r.SlowFetchers, KilledFetchers: r.KilledFetchers, LyingFetchers: r.LyingFetchers, RunS: time.Since(start).Seconds()}
			if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
				log.Print(err)
				return
			}
		}
	}
}

func ints(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v <= 0 {
			log.Fatalf("%q: not a positive integer", f)
		}
		out = append(out, v)
	}
	return out
}

// ms is d in milliseconds, to the microsecond.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
