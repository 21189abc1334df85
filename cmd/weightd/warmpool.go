package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/pagecache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/warmpool"
)

// warmConfig is the warm pool's part of the agent's configuration. Zero
// values mean the defaults (and the pool off).
type warmConfig struct {
	Warm                 bool          `help:"Hot-swap LoRA adapters into the warm servers (vLLM, SGLang) of this node, and keep their base models pinned in the cache." env:"WEIGHTD_WARM"`
	WarmStageDir         string        `help:"Host directory where adapters are staged for the warm servers, which mount it as a hostPath; on the cache's filesystem, staging is a hard link (empty: <root>/adapters)." env:"WEIGHTD_WARM_STAGE_DIR" type:"path"`
	WarmServerStageDir   string        `help:"The stage directory as the warm servers see it, the path their load requests name (empty: --warm-stage-dir)." env:"WEIGHTD_WARM_SERVER_STAGE_DIR"`
	WarmHealthInterval   time.Duration `help:"How often each warm server's health and loaded adapters are checked (0: 10s)." env:"WEIGHTD_WARM_HEALTH_INTERVAL"`
	WarmDRAMBudget       byteSize      `name:"warm-dram-budget" help:"Memory for the DRAM tier: the files of warm servers' bases are kept in the page cache (locked where CAP_IPC_LOCK allows) up to this many bytes, so a crashed server reloads at memory speed; the agent's memory limit must leave room for it. 0 turns it off." default:"0" env:"WEIGHTD_WARM_DRAM_BUDGET"`
	WarmPinBudgetPercent int           `help:"Most of the cache budget the bases of warm servers may hold pinned, in percent (1 to 100); a base that would go over is fetched but not pinned (0: 50)." env:"WEIGHTD_WARM_PIN_BUDGET_PERCENT"`
	WarmEviction         string        `help:"Which adapter a load that finds every slot taken unloads: lfu, the one of the fewest recent uses (counted for adapters not loaded too, halved as uses go by), or lru, the least recently used; never one pinned, in use or loading." default:"lfu" enum:"lfu,lru" env:"WEIGHTD_WARM_EVICTION"`
}

// defaultWarmPinBudgetPercent leaves half the cache evictable whatever
// warm servers claim, for the node's other pods.
const defaultWarmPinBudgetPercent = 50

// warmPinPrefix starts the pin owner of a warm server's base blobs:
// "warm:<namespace>/<pod>".
const warmPinPrefix = "warm:"

// newDRAMTier builds the DRAM tier for warm bases, or returns nil when the
// warm pool is off or has no DRAM budget. It starts nothing: the agent runs
// its Run.
func newDRAMTier(cfg warmConfig, log *slog.Logger, reg prometheus.Registerer) (*pagecache.Tier, error) {
	if !cfg.Warm || cfg.WarmDRAMBudget == 0 {
		return nil, nil
	}
	t, err := pagecache.New(int64(cfg.WarmDRAMBudget), pagecache.WithLogger(log), pagecache.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("--warm-dram-budget: %w", err)
	}
	log.Info("DRAM tier on for warm bases", "budget", cfg.WarmDRAMBudget)
	return t, nil
}

// newWarmPool builds the warm pool on the agent's prefetch queue and cache,
// or returns nil when --warm is off. dram keeps the bases' files in memory;
// nil without a DRAM budget. gpuUse reports the GPUs and GPU memory of a pod
// (by UID); nil without a GPU inventory. It starts nothing: the agent runs
// the pool's Run, and discovery feeds it SetServers.
func newWarmPool(cfg warmConfig, root string, queue *prefetch.Queue, store *cache.Store, dram *pagecache.Tier, gpuUse func(podUID string) ([]string, uint64), log *slog.Logger, reg prometheus.Registerer) (*warmpool.Pool, error) {
	if !cfg.Warm {
		return nil, nil
	}
	if cfg.WarmHealthInterval < 0 {
		return nil, fmt.Errorf("--warm-health-interval must not be negative, not %v", cfg.WarmHealthInterval)
	}
	share := cfg.WarmPinBudgetPercent
	if share == 0 {
		share = defaultWarmPinBudgetPercent
	}
	if share < 1 || share > 100 {
		return nil, fmt.Errorf("--warm-pin-budget-percent must be from 1 to 100, not %d", cfg.WarmPinBudgetPercent)
	}
	stage := cfg.WarmStageDir
	if stage == "" {
		stage = filepath.Join(root, "adapters")
	}
	pool, err := warmpool.New(warmpool.Config{
		StageDir:       stage,
		ServerStageDir: cfg.WarmServerStageDir,
		Fetcher:        adapterFetcher{queue},
		Bases:          &basePinner{queue: queue, store: store, dram: dram, log: log, share: share},
		GPUUse:         gpuUse,
		HealthInterval: cfg.WarmHealthInterval,
		Eviction:       cfg.WarmEviction,
		Logger:         log,
		Registerer:     reg,
	})
	if err != nil {
		return nil, err
	}
	log.Info("warm pool on", "stage-dir", stage, "eviction", cfg.WarmEviction)
	return pool, nil
}

// adapterFetcher fetches adapters through the prefetch queue (cache and
// swarm), at the priority of a waiting pod.
type adapterFetcher struct{ q *prefetch.Queue }

func (f adapterFetcher) Fetch(ctx context.Context, ref string) (string, error) {
	j, err := submitAndWait(ctx, f.q, ref, prefetch.PriorityPod, prefetch.ForNamespace(source.Requester(ctx)))
	if err != nil {
		return "", err
	}
	return j.Status().Dir, nil
}

// submitAndWait submits reference and waits for its job; a reference that
// does not parse is an api.ErrBadRequest.
func submitAndWait(ctx context.Context, q *prefetch.Queue, reference string, p prefetch.Priority, opts ...prefetch.SubmitOption) (*prefetch.Job, error) {
	j, err := q.Submit(reference, p, opts...)
	if errors.Is(err, ref.ErrInvalid) {
		return nil, fmt.Errorf("%w: %w", api.ErrBadRequest, err)
	}
	if err != nil {
		return nil, err
	}
	if _, err := j.Wait(ctx); err != nil {
		return nil, err
	}
	return j, nil
}

// basePinner keeps the base model of each warm server fetched and its blobs
// pinned in the cache under the owner "warm:<pod>", as long as all warm
// pins stay within share percent of the cache budget, and, with a DRAM
// tier, their files in memory under the same owner.
type basePinner struct {
	queue *prefetch.Queue
	store *cache.Store
	dram  *pagecache.Tier // nil: no DRAM tier
	log   *slog.Logger
	share int // percent of the cache budget
	// mu orders the share check and the pins of concurrent Keeps.
	mu sync.Mutex
}

func (b *basePinner) Keep(ctx context.Context, s warmpool.ServerSpec) error {
	// On behalf of the server pod's namespace: its base is what it named.
	ns, _, _ := strings.Cut(s.Pod, "/")
	j, err := submitAndWait(ctx, b.queue, s.Base, prefetch.PriorityNormal, prefetch.ForNamespace(ns))
	if err != nil {
		return fmt.Errorf("fetching base %s: %w", s.Base, err)
	}
	owner := warmPinPrefix + s.Pod
	paths, err := b.pin(s.Base, owner, j.Blobs())
	if err != nil {
		return err
	}
	if b.dram != nil {
		// Over the budget or not, the base is served: the tier says which
		// files it left out, and keeps trying as others are released.
		if err := b.dram.Keep(ctx, owner, paths); err != nil {
			b.log.Warn("DRAM tier keeps only part of a warm base", "pod", s.Pod, "base", s.Base, "err", err)
		}
	}
	return nil
}

// pin pins blobs for owner, unless the blobs pinned for every warm server
// would then exceed the share of the cache budget; it returns the blobs'
// paths.
func (b *basePinner) pin(base, owner string, blobs []content.Descriptor) ([]string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	limit := b.store.Usage().BudgetBytes / 100 * int64(b.share)
	counted := make(map[digest.Digest]bool)
	var total int64
	for _, info := range b.store.List() {
		if slices.ContainsFunc(info.Pins, func(p string) bool { return strings.HasPrefix(p, warmPinPrefix) && p != owner }) {
			counted[info.Digest] = true
			total += info.Size
		}
	}
	for _, d := range blobs {
		if !counted[d.Digest] {
			counted[d.Digest] = true
			total += d.Size
		}
	}
	if total > limit {
		return nil, fmt.Errorf("not pinning base %s: warm servers' bases would pin %d bytes, over --warm-pin-budget-percent (%d%% of the cache budget: %d bytes)",
			base, total, b.share, limit)
	}
	var paths []string
	for _, d := range blobs {
		if err := b.store.Pin(d.Digest, owner); err != nil {
			return nil, fmt.Errorf("pinning base %s: %w", base, err)
		}
		if p, err := b.store.BlobPath(d.Digest); err == nil {
			paths = append(paths, p)
		}
	}
	return paths, nil
}

// Drop unpins every blob pinned for s, including pins an earlier agent left.
func (b *basePinner) Drop(s warmpool.ServerSpec) {
	owner := warmPinPrefix + s.Pod
	if b.dram != nil {
		b.dram.Release(owner)
	}
	for _, info := range b.store.List() {
		if slices.Contains(info.Pins, owner) {
			if err := b.store.Unpin(info.Digest, owner); err != nil {
				b.log.Warn("unpinning the base of a warm server gone", "pod", s.Pod, "blob", info.Digest, "err", err)
			}
		}
	}
}
