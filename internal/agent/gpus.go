package agent

import (
	"errors"
	"log/slog"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/weightd/weightd/pkg/nvml"
)

// openGPUs opens the node's NVML (lib; gonvml.New() for the system's) for
// the agent. Where it cannot — no driver, or NVML failing — it logs why once
// and returns nil: the agent runs with its GPU features off, and
// weightd_gpu_available says 0.
func openGPUs(lib gonvml.Interface, procRoot string, log *slog.Logger) *nvml.Inventory {
	inv, err := nvml.New(lib, nvml.WithLogger(log), nvml.WithProcRoot(procRoot))
	switch {
	case errors.Is(err, nvml.ErrNoDriver):
		log.Info("GPU features off: no NVIDIA driver on this node", "err", err)
		return nil
	case err != nil:
		log.Warn("GPU features off: NVML fails", "err", err)
		return nil
	}
	return inv
}
