package agent

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/pagecache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/warmpool"
)

// WarmConfig is the warm pool's part of the agent's configuration. Zero
// values mean the defaults (and the pool off).
type WarmConfig struct {
	Warm                 bool          `help:"Hot-swap LoRA adapters into the warm servers (vLLM, SGLang) of this node, and keep their base models pinned in the cache." env:"WEIGHTD_WARM"`
	WarmStageDir         string        `help:"Host directory where adapters are staged for the warm servers, which mount it as a hostPath; on the cache's filesystem, staging is a hard link (empty: <root>/adapters)." env:"WEIGHTD_WARM_STAGE_DIR" type:"path"`
	WarmServerStageDir   string        `help:"The stage directory as the warm servers see it, the path their load requests name (empty: --warm-stage-dir)." env:"WEIGHTD_WARM_SERVER_STAGE_DIR"`
	WarmHealthInterval   time.Duration `help:"How often each warm server's health and loaded adapters are checked (0: 10s)." env:"WEIGHTD_WARM_HEALTH_INTERVAL"`
	WarmDRAMBudget       bytesize.Size `name:"warm-dram-budget" help:"Memory for the DRAM tier: the files of warm servers' bases are kept in the page cache (locked where CAP_IPC_LOCK allows) up to this many bytes, so a crashed server reloads at memory speed; the agent's memory limit must leave room for it. 0 turns it off." default:"0" env:"WEIGHTD_WARM_DRAM_BUDGET"`
	WarmPinBudgetPercent int           `help:"Most of the cache budget the bases of warm servers may hold pinned, in percent (1 to 100); a base that would go over is fetched but not pinned (0: 50)." env:"WEIGHTD_WARM_PIN_BUDGET_PERCENT"`
	WarmEviction         string        `help:"Which adapter a load that finds every slot taken unloads: lfu, the one of the fewest recent uses (counted for adapters not loaded too, halved as uses go by), or lru, the least recently used; never one pinned, in use or loading." default:"lfu" enum:"lfu,lru" env:"WEIGHTD_WARM_EVICTION"`
}

// defaultWarmPinBudgetPercent leaves half the cache evictable whatever
// warm servers claim, for the node's other pods.
const defaultWarmPinBudgetPercent = 50

// newDRAMTier builds the DRAM tier for warm bases, or returns nil when the
// warm pool is off or has no DRAM budget. It starts nothing: the agent runs
// its Run.
func newDRAMTier(cfg WarmConfig, log *slog.Logger, reg prometheus.Registerer) (*pagecache.Tier, error) {
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
func newWarmPool(cfg WarmConfig, root string, queue *prefetch.Queue, store *cache.Store, dram *pagecache.Tier, gpuUse func(podUID string) ([]string, uint64), log *slog.Logger, reg prometheus.Registerer) (*warmpool.Pool, error) {
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
		Fetcher:        warmpool.QueueFetcher{Queue: queue},
		Bases:          warmpool.NewBasePinner(queue, store, dram, share, log),
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
