package nvml

import (
	"log/slog"
	"slices"

	"github.com/weightd/weightd/pkg/api"
)

// apiGPUs converts the inventory's GPUs for the local API's status.
func apiGPUs(gpus []GPU) []api.GPU {
	out := make([]api.GPU, 0, len(gpus))
	for _, g := range gpus {
		out = append(out, api.GPU{
			Index:            g.Index,
			UUID:             g.UUID,
			Name:             g.Name,
			MemoryTotalBytes: g.MemoryTotalBytes,
			MemoryUsedBytes:  g.MemoryUsedBytes,
		})
	}
	return out
}

// APIGPUs returns what api.WithGPUs wants: the node's GPUs read from inv
// at each call (nil without a driver: inv is nil), each with the bases of
// the healthy warm servers whose processes use it (servers is nil without
// a warm pool). A failed read is logged and answers no GPUs.
func APIGPUs(inv *Inventory, servers func() []api.WarmServer, log *slog.Logger) func() []api.GPU {
	return func() []api.GPU {
		if inv == nil {
			return nil
		}
		gpus, err := inv.GPUs()
		if err != nil {
			log.Warn("reading GPUs", "err", err)
			return nil
		}
		out := apiGPUs(gpus)
		if servers == nil {
			return out
		}
		for _, s := range servers() {
			if !s.Healthy {
				continue
			}
			for i := range out {
				if slices.Contains(s.GPUs, out[i].UUID) && !slices.Contains(out[i].Bases, s.Base) {
					out[i].Bases = append(out[i].Bases, s.Base)
				}
			}
		}
		return out
	}
}

// PodUse returns what the warm pool wants to know of a warm server's pod:
// the UUIDs of the GPUs its processes use and their memory, read from inv at
// each call; nil without a driver (inv is nil). A failed read is logged and
// answers nothing.
func PodUse(inv *Inventory, log *slog.Logger) func(podUID string) ([]string, uint64) {
	if inv == nil {
		return nil
	}
	return func(podUID string) ([]string, uint64) {
		gpus, err := inv.GPUs()
		if err != nil {
			log.Warn("reading GPUs", "err", err)
			return nil, 0
		}
		return PodGPUs(gpus, podUID)
	}
}
