// Command adapterhit measures how often the warm pool's eviction policy
// finds an adapter already loaded: 100 adapters, 2 vLLM runtime test
// servers (internal/loratest) of 4 slots each, and two traces of requests
// drawn from a Zipf distribution with a fixed seed, each request an ensure
// through the real pool. The trace "zipf" keeps its popular set; in
// "zipf-shift" the same draws go through a random permutation of the
// adapters that is drawn again every -shift-every requests, so the popular
// set changes whole. Each trace runs through a pool with the default
// policy (warmpool.EvictLFU: fewest recent uses) and one with
// warmpool.EvictLRU. The ideal on the same trace is Belady's: on a miss with
// the 8 slots full, evict the adapter whose next request is farthest away.
//
//	go run ./bench/adapterhit          # 10,000 requests
//	go run ./bench/adapterhit -quick   # 2,000 requests
//
// The last two lines are one JSON object per trace:
//
//	{"bench":"adapter-hit","trace":"zipf","hit_ratio":…,"lru_hit_ratio":…,"belady_hit_ratio":…,"ratio_of_ideal":…}
//
// hit_ratio is the default policy's, ratio_of_ideal is hit_ratio over
// belady_hit_ratio.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/warmpool"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

type result struct {
	Bench          string  `json:"bench"`
	Trace          string  `json:"trace"`
	Eviction       string  `json:"eviction"`
	HitRatio       float64 `json:"hit_ratio"`
	LRUHitRatio    float64 `json:"lru_hit_ratio"`
	BeladyHitRatio float64 `json:"belady_hit_ratio"`
	RatioOfIdeal   float64 `json:"ratio_of_ideal"`
	Requests       int     `json:"requests"`
	Adapters       int     `json:"adapters"`
	Servers        int     `json:"servers"`
	SlotsPerServer int     `json:"slots_per_server"`
	ZipfS          float64 `json:"zipf_s"`
	ShiftEvery     int     `json:"shift_every,omitempty"`
	Seed           uint64  `json:"seed"`
}

const base = "hf://bench/base@main"

func main() {
	requests := flag.Int("requests", 10000, "requests in the trace")
	quick := flag.Bool("quick", false, "2,000 requests")
	adapters := flag.Int("adapters", 100, "distinct adapters")
	servers := flag.Int("servers", 2, "warm servers of the base")
	slots := flag.Int("slots", 4, "adapter slots per server")
	s := flag.Float64("zipf-s", 1.1, "Zipf exponent (> 1)")
	shiftEvery := flag.Int("shift-every", 1000, "requests between two shifts of the popular set in the trace zipf-shift")
	seed := flag.Uint64("seed", 42, "seed of the trace")
	flag.Parse()
	if *quick {
		*requests = 2000
	}
	if *requests < 1 || *adapters < 2 || *servers < 1 || *slots < 1 || *s <= 1 || *shiftEvery < 1 {
		log.Fatal("adapterhit: need requests, servers, slots, shift-every >= 1, adapters >= 2 and zipf-s > 1")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for _, tr := range []struct {
		name  string
		every int
	}{{"zipf", 0}, {"zipf-shift", *shiftEvery}} {
		trace := zipfTrace(*requests, *adapters, *s, *seed, tr.every)
		hits := map[string]int{}
		for _, policy := range []string{warmpool.EvictLRU, warmpool.EvictLFU} {
			n, err := replay(ctx, trace, *adapters, *servers, *slots, policy)
			if err != nil {
				log.Fatalf("adapterhit: %s, %s: %v", tr.name, policy, err)
			}
			hits[policy] = n
		}
		ratio := func(n int) float64 { return float64(n) / float64(len(trace)) }
		ideal := belady(trace, *servers**slots)
		res := result{
			Bench: "adapter-hit", Trace: tr.name, Eviction: warmpool.EvictLFU,
			HitRatio:       benchfig.Round(ratio(hits[warmpool.EvictLFU]), 4),
			LRUHitRatio:    benchfig.Round(ratio(hits[warmpool.EvictLRU]), 4),
			BeladyHitRatio: benchfig.Round(ratio(ideal), 4),
			RatioOfIdeal:   benchfig.Round(float64(hits[warmpool.EvictLFU])/float64(max(1, ideal)), 4),
			Requests:       len(trace), Adapters: *adapters, Servers: *servers, SlotsPerServer: *slots, ZipfS: *s, ShiftEvery: tr.every, Seed: *seed,
		}
		b, err := json.Marshal(res)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(string(b))
	}
}

// zipfTrace draws n adapter indexes in [0, adapters) from a Zipf
// distribution. Every shiftEvery requests (never when 0) the adapters take
// new ranks, a random permutation of their own: the same draws, another
// popular set. Without shifts, index 0 is the most popular.
func zipfTrace(n, adapters int, s float64, seed uint64, shiftEvery int) []int {
	z := rand.NewZipf(rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), s, 1, uint64(adapters-1))
	shuffle := rand.New(rand.NewPCG(seed+1, seed))
	perm := make([]int, adapters) // rank → adapter
	for i := range perm {
		perm[i] = i
	}
	trace := make([]int, n)
	for i := range trace {
		if shiftEvery > 0 && i > 0 && i%shiftEvery == 0 {
			shuffle.Shuffle(adapters, func(a, b int) { perm[a], perm[b] = perm[b], perm[a] })
		}
		trace[i] = perm[z.Uint64()]
	}
	return trace
}

// belady counts the hits of the optimal policy with the given slots.
func belady(trace []int, slots int) int {
	// next[i]: the index of the next request for trace[i] after i.
	next := make([]int, len(trace))
	last := map[int]int{}
	for i := len(trace) - 1; i >= 0; i-- {
		next[i] = math.MaxInt
		if j, ok := last[trace[i]]; ok {
			next[i] = j
		}
		last[trace[i]] = i
	}
	held := map[int]int{} // adapter → index of its next request
	hits := 0
	for i, a := range trace {
		if _, ok := held[a]; ok {
			hits++
		} else if len(held) == slots {
			victim, far := -1, -1
			for b, nb := range held {
				if nb > far {
					victim, far = b, nb
				}
			}
			delete(held, victim)
		}
		held[a] = next[i]
	}
	return hits
}

// dirFetcher serves adapters already on disk: the hit ratio does not depend
// on how they arrive.
type dirFetcher struct{ root string }

func (f dirFetcher) Fetch(_ context.Context, ref string) (string, error) {
	return filepath.Join(f.root, strings.TrimPrefix(ref, "bench://")), nil
}

type noBases struct{}

func (noBases) Keep(context.Context, warmpool.ServerSpec) error { return nil }
func (noBases) Drop(warmpool.ServerSpec)                        {}

// replay sends the trace through a real pool of the given eviction policy
// and counts the ensures that found their adapter loaded.
func replay(ctx context.Context, trace []int, adapters, servers, slots int, policy string) (int, error) {
	dir, err := os.MkdirTemp("", "adapterhit-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)
	for i := range adapters {
		if err := loratest.WriteAdapter(filepath.Join(dir, "src", fmt.Sprint(i)), loratest.AdapterSpec{Base: "base"}); err != nil {
			return 0, err
		}
	}
	pool, err := warmpool.New(warmpool.Config{
		StageDir: filepath.Join(dir, "adapters"), Fetcher: dirFetcher{filepath.Join(dir, "src")}, Bases: noBases{},
		HealthInterval: time.Hour, Eviction: policy,
	})
	if err != nil {
		return 0, err
	}
	var specs []warmpool.ServerSpec
	for i := range servers {
		srv, err := loratest.NewVLLM(loratest.Options{Base: "base", Slots: slots})
		if err != nil {
			return 0, err
		}
		defer srv.Close()
		specs = append(specs, warmpool.ServerSpec{Pod: fmt.Sprintf("bench/warm-%d", i), Base: base, Runtime: engine.VLLM, Endpoint: srv.URL(), Slots: slots})
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- pool.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			log.Printf("adapterhit: pool: %v", err)
		}
	}()
	pool.SetServers(specs)
	healthy := func(s api.WarmServer) bool { return s.Healthy }
	for len(pool.Servers()) != servers || !allOf(pool.Servers(), healthy) {
		select {
		case <-pool.Changed():
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	hits := 0
	for _, a := range trace {
		ans, err := pool.Ensure(ctx, api.AdapterRequest{Base: base, Ref: fmt.Sprintf("bench://%d", a), Name: fmt.Sprintf("lora-%d", a)})
		if err != nil {
			return 0, err
		}
		if !ans.Loaded {
			hits++
		}
	}
	return hits, nil
}

func allOf[T any](xs []T, ok func(T) bool) bool {
	return !slices.ContainsFunc(xs, func(x T) bool { return !ok(x) })
}
