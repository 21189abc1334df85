package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/nvml"
)

// gpusCmd prints the node's GPUs straight from NVML, as nvidia-smi would,
// with the pod of each compute process. It needs no agent.
type gpusCmd struct {
	JSON     bool   `name:"json" help:"Print the GPUs as JSON."`
	ProcRoot string `name:"proc-root" help:"Where the host's procfs is mounted, to map GPU processes to pods." default:"/proc" env:"WEIGHTD_PROC_ROOT"`

	// lib is the NVML to read; nil is the system's. Tests set a fake.
	lib gonvml.Interface
}

func (c *gpusCmd) Run(e *env) error {
	lib := c.lib
	if lib == nil {
		lib = gonvml.New()
	}
	inv, err := nvml.New(lib, nvml.WithProcRoot(c.ProcRoot))
	if errors.Is(err, nvml.ErrNoDriver) {
		return fmt.Errorf("no GPUs to show: %w", err)
	}
	if err != nil {
		return err
	}
	defer inv.Close()
	gpus, err := inv.GPUs()
	if err != nil {
		return err
	}
	if c.JSON {
		return printJSON(e.stdout, gpus)
	}
	return printGPUs(e.stdout, gpus)
}

// printGPUs writes nvidia-smi-like tables: the GPUs, then their MIG
// instances and compute processes where there are any, then what NVML
// would not answer.
func printGPUs(w io.Writer, gpus []nvml.GPU) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tNAME\tUUID\tMEMORY\tMIG")
	var migs, procs, errs int
	for _, g := range gpus {
		mig := "off"
		if g.MIGEnabled {
			mig = fmt.Sprintf("%d instances", len(g.MIG))
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\n", g.Index, orDash(g.Name), orDash(g.UUID), mib(g.MemoryUsedBytes, g.MemoryTotalBytes), mig)
		migs += len(g.MIG)
		procs += len(g.Processes)
		errs += len(g.Errors)
	}
	if migs > 0 {
		fmt.Fprintln(tw, "\nGPU\tGI\tCI\tPROFILE\tMIG UUID\tMEMORY")
		for _, g := range gpus {
			for _, m := range g.MIG {
				profile := "-"
				if m.ProfileID >= 0 {
					profile = strconv.Itoa(m.ProfileID)
				}
				fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%s\t%s\n", g.Index, m.GPUInstanceID, m.ComputeInstanceID, profile, orDash(m.UUID), mib(m.MemoryUsedBytes, m.MemoryTotalBytes))
			}
		}
	}
	if procs > 0 {
		fmt.Fprintln(tw, "\nGPU\tPID\tMEMORY\tPOD UID\tMIG UUID")
		for _, g := range gpus {
			for _, p := range g.Processes {
				fmt.Fprintf(tw, "%d\t%d\t%dMiB\t%s\t%s\n", g.Index, p.PID, p.UsedMemoryBytes>>20, orDash(p.PodUID), orDash(p.MIG))
			}
		}
	}
	if errs > 0 {
		fmt.Fprintln(tw, "\nGPU\tERROR")
		for _, g := range gpus {
			for _, e := range g.Errors {
				fmt.Fprintf(tw, "%d\t%s\n", g.Index, e)
			}
		}
	}
	return tw.Flush()
}

// mib formats used and total memory as nvidia-smi does; "-" for a GPU whose
// memory NVML would not tell.
func mib(used, total uint64) string {
	if total == 0 {
		return "-"
	}
	return fmt.Sprintf("%dMiB / %dMiB", used>>20, total>>20)
}

func orDash(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}

// apiGPUs converts the inventory's GPUs for the local API's status.
func apiGPUs(gpus []nvml.GPU) []api.GPU {
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

// gpuStatus returns what api.WithGPUs wants: the node's GPUs read from inv
// at each call (nil without a driver: inv is nil), each with the bases of
// the healthy warm servers whose processes use it (servers is nil without
// a warm pool). A failed read is logged and answers no GPUs.
func gpuStatus(inv *nvml.Inventory, servers func() []api.WarmServer, log *slog.Logger) func() []api.GPU {
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

// gpuUse returns what the warm pool wants to know of a warm server's pod:
// the UUIDs of the GPUs its processes use and their memory, read from inv at
// each call; nil without a driver (inv is nil). A failed read is logged and
// answers nothing.
func gpuUse(inv *nvml.Inventory, log *slog.Logger) func(podUID string) ([]string, uint64) {
	if inv == nil {
		return nil
	}
	return func(podUID string) ([]string, uint64) {
		gpus, err := inv.GPUs()
		if err != nil {
			log.Warn("reading GPUs", "err", err)
			return nil, 0
		}
		return nvml.PodGPUs(gpus, podUID)
	}
}
