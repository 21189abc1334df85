package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"

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
