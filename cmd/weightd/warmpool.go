package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/warmpool"
)

// warmConfig is the warm pool's part of the agent's configuration. Zero
// values mean the defaults (and the pool off).
type warmConfig struct {
	Warm               bool          `help:"Hot-swap LoRA adapters into the warm servers (vLLM, SGLang) of this node, and keep their base models pinned in the cache." env:"WEIGHTD_WARM"`
	WarmStageDir       string        `help:"Host directory where adapters are staged for the warm servers, which mount it as a hostPath; on the cache's filesystem, staging is a hard link (empty: <root>/adapters)." env:"WEIGHTD_WARM_STAGE_DIR" type:"path"`
	WarmServerStageDir string        `help:"The stage directory as the warm servers see it, the path their load requests name (empty: --warm-stage-dir)." env:"WEIGHTD_WARM_SERVER_STAGE_DIR"`
	WarmHealthInterval time.Duration `help:"How often each warm server's health and loaded adapters are checked (0: 10s)." env:"WEIGHTD_WARM_HEALTH_INTERVAL"`
}

// warmPinPrefix starts the pin owner of a warm server's base blobs:
// "warm:<namespace>/<pod>".
const warmPinPrefix = "warm:"

// newWarmPool builds the warm pool on the agent's prefetch queue and cache,
// or returns nil when --warm is off. gpuUse reports the GPUs and GPU memory
// of a pod (by UID); nil without a GPU inventory. It starts nothing: the
// agent runs the pool's Run, and discovery feeds it SetServers.
func newWarmPool(cfg warmConfig, root string, queue *prefetch.Queue, store *cache.Store, gpuUse func(podUID string) ([]string, uint64), log *slog.Logger, reg prometheus.Registerer) (*warmpool.Pool, error) {
	if !cfg.Warm {
		return nil, nil
	}
	if cfg.WarmHealthInterval < 0 {
		return nil, fmt.Errorf("--warm-health-interval must not be negative, not %v", cfg.WarmHealthInterval)
	}
	stage := cfg.WarmStageDir
	if stage == "" {
		stage = filepath.Join(root, "adapters")
	}
	pool, err := warmpool.New(warmpool.Config{
		StageDir:       stage,
		ServerStageDir: cfg.WarmServerStageDir,
		Fetcher:        adapterFetcher{queue},
		Bases:          basePinner{queue: queue, store: store, log: log},
		GPUUse:         gpuUse,
		HealthInterval: cfg.WarmHealthInterval,
		Logger:         log,
		Registerer:     reg,
	})
	if err != nil {
		return nil, err
	}
	log.Info("warm pool on", "stage-dir", stage)
	return pool, nil
}

// adapterFetcher fetches adapters through the prefetch queue (cache and
// swarm), at the priority of a waiting pod.
type adapterFetcher struct{ q *prefetch.Queue }

func (f adapterFetcher) Fetch(ctx context.Context, ref string) (string, error) {
	j, err := submitAndWait(ctx, f.q, ref, prefetch.PriorityPod)
	if err != nil {
		return "", err
	}
	return j.Status().Dir, nil
}

// submitAndWait submits ref and waits for its job; a reference that does
// not parse is an api.ErrBadRequest.
func submitAndWait(ctx context.Context, q *prefetch.Queue, ref string, p prefetch.Priority) (*prefetch.Job, error) {
	j, err := q.Submit(ref, p)
	if errors.Is(err, cache.ErrInvalid) {
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
// pinned in the cache under the owner "warm:<pod>".
type basePinner struct {
	queue *prefetch.Queue
	store *cache.Store
	log   *slog.Logger
}

func (b basePinner) Keep(ctx context.Context, s warmpool.ServerSpec) error {
	j, err := submitAndWait(ctx, b.queue, s.Base, prefetch.PriorityNormal)
	if err != nil {
		return fmt.Errorf("fetching base %s: %w", s.Base, err)
	}
	for _, d := range j.Blobs() {
		if err := b.store.Pin(d.Digest, warmPinPrefix+s.Pod); err != nil {
			return fmt.Errorf("pinning base %s: %w", s.Base, err)
		}
	}
	return nil
}

// Drop unpins every blob pinned for s, including pins an earlier agent left.
func (b basePinner) Drop(s warmpool.ServerSpec) {
	owner := warmPinPrefix + s.Pod
	for _, info := range b.store.List() {
		if slices.Contains(info.Pins, owner) {
			if err := b.store.Unpin(info.Digest, owner); err != nil {
				b.log.Warn("unpinning the base of a warm server gone", "pod", s.Pod, "blob", info.Digest, "err", err)
			}
		}
	}
}
