// Command adapterswap measures the overhead weightd adds to a LoRA adapter
// hot-swap when the adapter is already in the cache: -n ensures (1,000 by
// default) through the warm pool against a vLLM runtime test server
// (internal/loratest) that answers at once, with one slot fewer than the
// adapters asked for in turn, so that every ensure is a swap: the adapter's
// directory in the cache (fetched once through the real prefetch queue from
// a loopback origin), check with lora.Inspect, stage by hard links from the
// cache's blobs, evict the adapter used longest ago (an unload request),
// load (a load request) and verify (a listing). The same swaps are also
// timed with every fetch going through the prefetch queue again (queue_*:
// the manifest fetched from the origin, the blobs found in the cache, the
// model's snapshot directory checked and found intact, so not written again).
//
//	go run ./bench/adapterswap          # 1,000 swaps
//	go run ./bench/adapterswap -quick   # 100 swaps
//
// The last line is one JSON object:
//
//	{"bench":"adapter-swap","n":1000,"p50_ms":…,"p99_ms":…}
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/lora"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/warmpool"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

type result struct {
	Bench string  `json:"bench"`
	N     int     `json:"n"`
	P50ms float64 `json:"p50_ms"`
	P99ms float64 `json:"p99_ms"`
	MaxMs float64 `json:"max_ms"`
	// QueueP50ms and QueueP99ms time the same swaps with the fetch going
	// through the prefetch queue each time (manifest from the origin,
	// blobs found in the cache, the model directory checked and found
	// intact).
	QueueP50ms float64 `json:"queue_p50_ms"`
	QueueP99ms float64 `json:"queue_p99_ms"`
	Adapters   int     `json:"adapters"`
	Slots      int     `json:"slots"`
}

const base = "hf://bench/base@main"

func main() {
	n := flag.Int("n", 1000, "ensures timed, each a swap")
	quick := flag.Bool("quick", false, "100 ensures")
	adapters := flag.Int("adapters", 3, "adapters asked for in turn (the server has one slot fewer)")
	flag.Parse()
	if *quick {
		*n = 100
	}
	if *n < 1 || *adapters < 2 {
		log.Fatal("adapterswap: need -n >= 1 and -adapters >= 2")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	res, err := run(ctx, *n, *adapters)
	if err != nil {
		log.Fatalf("adapterswap: %v", err)
	}
	b, err := json.Marshal(res)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(b))
}

// queueFetcher fetches through the prefetch queue, as the agent does, and
// remembers the directory of each reference.
type queueFetcher struct {
	q    *prefetch.Queue
	dirs map[string]string
	// cached answers from dirs once a reference was fetched.
	cached bool
}

func (f *queueFetcher) Fetch(ctx context.Context, ref string) (string, error) {
	if d, ok := f.dirs[ref]; ok && f.cached {
		return d, nil
	}
	j, err := f.q.Submit(ref, prefetch.PriorityPod)
	if err != nil {
		return "", err
	}
	st, err := j.Wait(ctx)
	if err != nil {
		return "", err
	}
	f.dirs[ref] = st.Dir
	return st.Dir, nil
}

type noBases struct{}

func (noBases) Keep(context.Context, warmpool.ServerSpec) error { return nil }
func (noBases) Drop(warmpool.ServerSpec)                        {}

func run(ctx context.Context, n, adapters int) (result, error) {
	dir, err := os.MkdirTemp("", "adapterswap-")
	if err != nil {
		return result{}, err
	}
	defer os.RemoveAll(dir)
	originDir := filepath.Join(dir, "origin")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return result{}, err
	}
	orig := genmodel.NewServer(ln, originDir)
	refs := make([]string, adapters)
	for i := range refs {
		name := fmt.Sprintf("lora-%d", i)
		if err := writeAdapter(filepath.Join(originDir, name), name); err != nil {
			return result{}, err
		}
		refs[i] = orig.URL() + "/" + name + "/model.json"
	}
	store, err := cache.Open(filepath.Join(dir, "cache"), cache.WithChunkSize(1<<20))
	if err != nil {
		return result{}, err
	}
	defer store.Close()
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	srv, err := loratest.NewVLLM(loratest.Options{Base: "base", Slots: adapters - 1})
	if err != nil {
		return result{}, err
	}
	defer srv.Close()
	fetch := &queueFetcher{q: queue, dirs: map[string]string{}}
	pool, err := warmpool.New(warmpool.Config{
		StageDir: filepath.Join(dir, "adapters"), Fetcher: fetch, Bases: noBases{},
		HealthInterval: time.Hour,
	})
	if err != nil {
		return result{}, err
	}

	ctx, cancel := context.WithCancel(ctx)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return orig.Run(gctx) })
	g.Go(func() error { return queue.Run(gctx) })
	g.Go(func() error { return pool.Run(gctx) })
	var res result
	err = func() error {
		pool.SetServers([]warmpool.ServerSpec{{Pod: "bench/warm-0", Base: base, Runtime: engine.VLLM, Endpoint: srv.URL(), Slots: adapters - 1}})
		for !slices.ContainsFunc(pool.Servers(), func(s api.WarmServer) bool { return s.Healthy }) {
			select {
			case <-pool.Changed():
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		// Bring every adapter into the cache, and warm up.
		for i := range 2 * adapters {
			if _, err := pool.Ensure(ctx, api.AdapterRequest{Base: base, Ref: refs[i%adapters]}); err != nil {
				return err
			}
		}
		k := 0 // the next adapter is refs[k%adapters]: the least recently used
		swaps := func() ([]float64, error) {
			times := make([]float64, 0, n)
			for range n {
				t0 := time.Now()
				ans, err := pool.Ensure(ctx, api.AdapterRequest{Base: base, Ref: refs[k%adapters]})
				k++
				d := time.Since(t0)
				if err != nil {
					return nil, err
				}
				if !ans.Loaded {
					return nil, errors.New("an ensure found its adapter loaded: not a swap")
				}
				times = append(times, float64(d)/float64(time.Millisecond))
			}
			slices.Sort(times)
			return times, nil
		}
		queued, err := swaps()
		if err != nil {
			return err
		}
		fetch.cached = true
		times, err := swaps()
		if err != nil {
			return err
		}
		res = result{
			Bench: "adapter-swap", N: n, P50ms: benchfig.Round(quantile(times, 0.50), 3), P99ms: benchfig.Round(quantile(times, 0.99), 3),
			MaxMs: benchfig.Round(times[len(times)-1], 3), QueueP50ms: benchfig.Round(quantile(queued, 0.50), 3), QueueP99ms: benchfig.Round(quantile(queued, 0.99), 3),
			Adapters: adapters, Slots: adapters - 1,
		}
		if peak := srv.Peak(); peak > adapters-1 {
			return fmt.Errorf("the server held %d adapters at once, slots %d", peak, adapters-1)
		}
		return nil
	}()
	cancel()
	if werr := g.Wait(); err == nil {
		err = werr
	}
	return res, err
}

// writeAdapter writes an adapter into dir with the manifest that serves it
// over HTTP (model.json).
func writeAdapter(dir, name string) error {
	if err := loratest.WriteAdapter(dir, loratest.AdapterSpec{Base: "base"}); err != nil {
		return err
	}
	m := httpsource.Manifest{Name: "bench/" + name, Revision: "main"}
	for _, f := range []string{lora.ConfigFile, lora.WeightsFile} {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			return err
		}
		sum := sha256.Sum256(b)
		m.Files = append(m.Files, httpsource.ManifestFile{Path: f, Size: int64(len(b)), SHA256: hex.EncodeToString(sum[:])})
	}
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "model.json"), b, 0o644)
}

// quantile of sorted xs, nearest rank.
func quantile(xs []float64, q float64) float64 {
	i := int(math.Ceil(q*float64(len(xs)))) - 1
	return xs[max(0, min(i, len(xs)-1))]
}
