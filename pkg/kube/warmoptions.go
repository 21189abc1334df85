package kube

import (
	"log/slog"
	"time"
)

// WarmOption configures a WarmPods.
type WarmOption func(*warmConfig)

type warmConfig struct {
	interval            time.Duration
	workers             int
	ensureTimeout       time.Duration
	retryBase, retryMax time.Duration
	logger              *slog.Logger
	serverNamespaces    map[string]bool // may hold warm servers for their own pods
	sharedNamespaces    map[string]bool // may hold warm servers for every namespace's pods
	shared              *Shared
}

// WithWarmShared has WarmPods watch pods and record Events through what the
// agent's components share.
func WithWarmShared(s *Shared) WarmOption {
	return func(c *warmConfig) { c.shared = s }
}

// WithWarmServerNamespaces names the namespaces whose pods may be warm
// servers; each such server takes adapters only for pods of its own
// namespace. A pod labelled a warm server in a namespace named neither here
// nor by WithWarmSharedNamespaces is ignored, with a Warning Event saying
// why. Default: none, as a warm server receives other pods' adapters and
// pins its base in the node's cache.
func WithWarmServerNamespaces(namespaces ...string) WarmOption {
	return func(c *warmConfig) {
		for _, ns := range namespaces {
			c.serverNamespaces[ns] = true
		}
	}
}

// WithWarmSharedNamespaces names the namespaces whose warm servers take
// adapters for pods of every namespace: a shared inference namespace
// serving many teams. Default: none.
func WithWarmSharedNamespaces(namespaces ...string) WarmOption {
	return func(c *warmConfig) {
		for _, ns := range namespaces {
			c.sharedNamespaces[ns] = true
		}
	}
}

// WithWarmInterval sets how long WarmPods lets changes settle before it
// gives the pool the node's warm servers and writes their loaded-adapters
// annotations (default 1s; d <= 0 keeps it): a burst of changes is one
// round of writes.
func WithWarmInterval(d time.Duration) WarmOption {
	return func(c *warmConfig) {
		if d > 0 {
			c.interval = d
		}
	}
}

// WithWarmWorkers sets how many adapter requests are served at once
// (default 4; n < 1 keeps it). An ensure that fetches an adapter holds its
// worker until the adapter is loaded.
func WithWarmWorkers(n int) WarmOption {
	return func(c *warmConfig) {
		if n >= 1 {
			c.workers = n
		}
	}
}

// WithEnsureTimeout bounds one ensure of an adapter, its download included
// (default 10m; d <= 0 keeps it).
func WithEnsureTimeout(d time.Duration) WarmOption {
	return func(c *warmConfig) {
		if d > 0 {
			c.ensureTimeout = d
		}
	}
}

// WithWarmRetry sets the backoff of an adapter request that failed for a
// reason that may pass (and of a failed write): base, doubling per failure,
// up to most (defaults 1s and 2m; values <= 0 keep them).
func WithWarmRetry(base, most time.Duration) WarmOption {
	return func(c *warmConfig) {
		if base > 0 {
			c.retryBase = base
		}
		if most > 0 {
			c.retryMax = most
		}
	}
}

// WithWarmLogger sets the logger (default: discard).
func WithWarmLogger(l *slog.Logger) WarmOption {
	return func(c *warmConfig) {
		if l != nil {
			c.logger = l
		}
	}
}
