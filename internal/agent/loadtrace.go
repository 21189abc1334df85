package agent

import (
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/loadtrace"
)

// LoadTraceConfig is the model-load tracer's part of the agent's
// configuration. Its zero value turns the tracer off (the demo and tests);
// the agent command's default turns it on.
type LoadTraceConfig struct {
	LoadTrace      bool   `help:"Trace model loads with eBPF: per pod and model, first open to last close of the cache's files, and the order files are first read, which later prefetches follow. Where eBPF cannot load, the agent logs once and runs without it." default:"true" negatable:"" env:"WEIGHTD_LOAD_TRACE"`
	LoadTraceMount string `help:"The path at which pods mount the cache root, if they do; models/ and blobs/sha256/ under it are traced besides the host's." env:"WEIGHTD_LOAD_TRACE_MOUNT"`
	CgroupRoot     string `help:"The cgroup v2 mount under which the load tracer finds pods." default:"/sys/fs/cgroup" env:"WEIGHTD_CGROUP_ROOT"`
}

// loadTracer builds the model-load tracer over the cache under root, or
// returns nil when it is off. It loads nothing into the kernel: Run does.
func (c LoadTraceConfig) loadTracer(root string, log *slog.Logger, reg prometheus.Registerer) (*loadtrace.Tracer, error) {
	if !c.LoadTrace {
		return nil, nil
	}
	models := []string{filepath.Join(root, "models")}
	blobs := []string{filepath.Join(root, "blobs", "sha256")}
	if m := c.LoadTraceMount; m != "" {
		if !filepath.IsAbs(m) {
			return nil, fmt.Errorf("--load-trace-mount: %q is not an absolute path", m)
		}
		models = append(models, filepath.Join(m, "models"))
		blobs = append(blobs, filepath.Join(m, "blobs", "sha256"))
	}
	t, err := loadtrace.New(loadtrace.Config{
		ModelsDirs: models,
		BlobsDirs:  blobs,
		StateDir:   filepath.Join(root, "loadtrace"),
		CgroupRoot: c.CgroupRoot,
		Registerer: reg,
		Logger:     log,
	})
	if err != nil {
		return nil, fmt.Errorf("model-load tracer: %w", err)
	}
	return t, nil
}
