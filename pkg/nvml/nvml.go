package nvml

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/weightd/weightd/pkg/podcgroup"
)

// ErrNoDriver is returned by Open on a node without the NVIDIA driver or its
// library (libnvidia-ml.so.1).
var ErrNoDriver = errors.New("no NVIDIA driver: libnvidia-ml.so.1 not found or the kernel driver is not loaded")

// GPU is one GPU of the node.
type GPU struct {
	Index int    `json:"index"`
	UUID  string `json:"uuid"`
	Name  string `json:"name"`
	// Memory as NVML reports it; Used excludes the driver's reservation
	// where the driver can say (as nvidia-smi shows it).
	MemoryTotalBytes uint64 `json:"memoryTotalBytes"`
	MemoryUsedBytes  uint64 `json:"memoryUsedBytes"`
	MemoryFreeBytes  uint64 `json:"memoryFreeBytes"`
	// MIGEnabled is true when the GPU is partitioned; MIG lists its
	// instances.
	MIGEnabled bool          `json:"migEnabled"`
	MIG        []MIGInstance `json:"mig,omitempty"`
	// Processes are the compute processes on the GPU (on its MIG instances
	// when partitioned).
	Processes []Process `json:"processes,omitempty"`
	// Errors are the queries that failed for this GPU, each "what: why";
	// the fields they would have filled are left zero.
	Errors []string `json:"errors,omitempty"`
}

// MIGInstance is one MIG device: a compute instance within a GPU instance.
type MIGInstance struct {
	UUID              string `json:"uuid"`
	GPUInstanceID     int    `json:"gpuInstanceId"`
	ComputeInstanceID int    `json:"computeInstanceId"`
	// ProfileID is the GPU instance's profile (nvml.GPU_INSTANCE_PROFILE_*),
	// -1 when NVML would not say.
	ProfileID        int    `json:"profileId"`
	MemoryTotalBytes uint64 `json:"memoryTotalBytes"`
	MemoryUsedBytes  uint64 `json:"memoryUsedBytes"`
}

// Process is a compute process on a GPU.
type Process struct {
	PID             int    `json:"pid"`
	UsedMemoryBytes uint64 `json:"usedMemoryBytes"`
	// MIG is the UUID of the MIG instance the process runs on, if any.
	MIG string `json:"mig,omitempty"`
	// PodUID and ContainerID are empty for a process outside any pod (or
	// one whose cgroup could not be read: it may have exited).
	PodUID      string `json:"podUID,omitempty"`
	ContainerID string `json:"containerID,omitempty"`
}

// Option configures an Inventory.
type Option func(*Inventory)

// WithLogger sets where the inventory logs (silent by default).
func WithLogger(log *slog.Logger) Option {
	return func(i *Inventory) { i.log = log }
}

// WithProcRoot sets where the host's procfs is mounted ("/proc" by default:
// the agent's DaemonSet shares the host's PID namespace, hostPID, so its
// /proc is the host's), to map processes to pods.
func WithProcRoot(dir string) Option {
	return func(i *Inventory) { i.procRoot = dir }
}

// Inventory reads the node's GPUs from NVML. Safe for concurrent use (NVML
// is thread-safe).
type Inventory struct {
	lib      gonvml.Interface
	log      *slog.Logger
	procRoot string
}

// Open initializes the system's NVML library. It returns ErrNoDriver where
// there is none.
func Open(opts ...Option) (*Inventory, error) {
	return New(gonvml.New(), opts...)
}

// New initializes lib and returns an Inventory reading it. It returns
// ErrNoDriver when lib finds no driver. Close shuts lib down.
func New(lib gonvml.Interface, opts ...Option) (*Inventory, error) {
	i := &Inventory{lib: lib, log: slog.New(slog.DiscardHandler), procRoot: "/proc"}
	for _, o := range opts {
		o(i)
	}
	switch ret := lib.Init(); ret {
	case gonvml.SUCCESS:
		return i, nil
	case gonvml.ERROR_LIBRARY_NOT_FOUND, gonvml.ERROR_DRIVER_NOT_LOADED:
		return nil, fmt.Errorf("initializing NVML: %w (%w)", ErrNoDriver, ret)
	default:
		return nil, fmt.Errorf("initializing NVML: %w", ret)
	}
}

// Close shuts NVML down.
func (i *Inventory) Close() error {
	if ret := i.lib.Shutdown(); ret != gonvml.SUCCESS {
		return fmt.Errorf("shutting NVML down: %w", ret)
	}
	return nil
}

// GPUs returns every GPU of the node, in index order. It fails only when
// NVML cannot count them; a GPU that fails a query carries the error in
// its Errors.
func (i *Inventory) GPUs() ([]GPU, error) {
	n, ret := i.lib.DeviceGetCount()
	if ret != gonvml.SUCCESS {
		return nil, fmt.Errorf("counting GPUs: %w", ret)
	}
	gpus := make([]GPU, 0, n)
	for idx := range n {
		gpus = append(gpus, i.gpu(idx))
	}
	return gpus, nil
}

// gpu reads GPU idx.
func (i *Inventory) gpu(idx int) GPU {
	g := GPU{Index: idx}
	fail := func(what string, ret gonvml.Return) {
		g.Errors = append(g.Errors, what+": "+ret.Error())
		i.log.Debug("NVML query failed", "gpu", idx, "query", what, "err", ret.Error())
	}
	d, ret := i.lib.DeviceGetHandleByIndex(idx)
	if ret != gonvml.SUCCESS {
		fail("handle", ret)
		return g
	}
	if g.UUID, ret = d.GetUUID(); ret != gonvml.SUCCESS {
		fail("uuid", ret)
	}
	if g.Name, ret = d.GetName(); ret != gonvml.SUCCESS {
		fail("name", ret)
	}
	if total, used, free, ret := memory(d); ret != gonvml.SUCCESS {
		fail("memory", ret)
	} else {
		g.MemoryTotalBytes, g.MemoryUsedBytes, g.MemoryFreeBytes = total, used, free
	}
	mode, _, ret := d.GetMigMode()
	switch ret {
	case gonvml.SUCCESS:
		g.MIGEnabled = mode == gonvml.DEVICE_MIG_ENABLE
	case gonvml.ERROR_NOT_SUPPORTED: // a GPU without MIG
	default:
		fail("mig mode", ret)
	}
	if !g.MIGEnabled {
		procs, ret := d.GetComputeRunningProcesses()
		if ret != gonvml.SUCCESS {
			fail("processes", ret)
		}
		g.Processes = i.processes(procs, "")
		return g
	}
	// A partitioned GPU lists its processes per MIG device (the parent
	// lists them only to root).
	count, ret := d.GetMaxMigDeviceCount()
	if ret != gonvml.SUCCESS {
		fail("mig device count", ret)
		return g
	}
	for m := range count {
		md, ret := d.GetMigDeviceHandleByIndex(m)
		if ret == gonvml.ERROR_NOT_FOUND {
			continue // an empty slot
		}
		if ret != gonvml.SUCCESS {
			fail(fmt.Sprintf("mig device %d", m), ret)
			continue
		}
		mi, errs := migInstance(d, md)
		for _, e := range errs {
			g.Errors = append(g.Errors, fmt.Sprintf("mig device %d %s", m, e))
		}
		g.MIG = append(g.MIG, mi)
		procs, ret := md.GetComputeRunningProcesses()
		if ret != gonvml.SUCCESS {
			fail(fmt.Sprintf("mig device %d processes", m), ret)
		}
		g.Processes = append(g.Processes, i.processes(procs, mi.UUID)...)
	}
	return g
}

// memory returns a device's total, used and free memory: from
// GetMemoryInfo_v2 (used without the driver's reservation, as nvidia-smi
// shows it), else from GetMemoryInfo on a driver without it.
func memory(d gonvml.Device) (total, used, free uint64, _ gonvml.Return) {
	m2, ret := d.GetMemoryInfo_v2()
	switch ret {
	case gonvml.SUCCESS:
		return m2.Total, m2.Used, m2.Free, ret
	case gonvml.ERROR_FUNCTION_NOT_FOUND, gonvml.ERROR_NOT_SUPPORTED, gonvml.ERROR_ARGUMENT_VERSION_MISMATCH:
		m, ret := d.GetMemoryInfo()
		return m.Total, m.Used, m.Free, ret
	default:
		return 0, 0, 0, ret
	}
}

// migInstance reads MIG device md of parent d, and the queries that failed.
func migInstance(d, md gonvml.Device) (MIGInstance, []string) {
	mi := MIGInstance{GPUInstanceID: -1, ComputeInstanceID: -1, ProfileID: -1}
	var errs []string
	var ret gonvml.Return
	if mi.UUID, ret = md.GetUUID(); ret != gonvml.SUCCESS {
		errs = append(errs, "uuid: "+ret.Error())
	}
	if mi.GPUInstanceID, ret = md.GetGpuInstanceId(); ret != gonvml.SUCCESS {
		mi.GPUInstanceID = -1
		errs = append(errs, "gpu instance: "+ret.Error())
	}
	if mi.ComputeInstanceID, ret = md.GetComputeInstanceId(); ret != gonvml.SUCCESS {
		mi.ComputeInstanceID = -1
		errs = append(errs, "compute instance: "+ret.Error())
	}
	if total, used, _, ret := memory(md); ret != gonvml.SUCCESS {
		errs = append(errs, "memory: "+ret.Error())
	} else {
		mi.MemoryTotalBytes, mi.MemoryUsedBytes = total, used
	}
	// The profile needs the GPU instance, which NVML shows only to root:
	// without it the profile stays unknown, which is no error.
	if mi.GPUInstanceID >= 0 {
		if gi, ret := d.GetGpuInstanceById(mi.GPUInstanceID); ret == gonvml.SUCCESS {
			if info, ret := gi.GetInfo(); ret == gonvml.SUCCESS {
				mi.ProfileID = int(info.ProfileId)
			}
		}
	}
	return mi, errs
}

// processes converts NVML's process list, mapping each process to its pod.
func (i *Inventory) processes(infos []gonvml.ProcessInfo, mig string) []Process {
	out := make([]Process, 0, len(infos))
	for _, p := range infos {
		pr := Process{PID: int(p.Pid), UsedMemoryBytes: p.UsedGpuMemory, MIG: mig}
		pod, err := podcgroup.FromProc(i.procRoot, pr.PID)
		switch {
		case err == nil:
			pr.PodUID, pr.ContainerID = pod.UID, pod.ContainerID
		case errors.Is(err, podcgroup.ErrNotPod), errors.Is(err, os.ErrNotExist):
			// a host process, or one that exited since NVML listed it
		default:
			i.log.Debug("reading a GPU process's cgroup", "pid", pr.PID, "err", err)
		}
		out = append(out, pr)
	}
	slices.SortFunc(out, func(a, b Process) int { return a.PID - b.PID })
	if len(out) == 0 {
		return nil
	}
	return out
}

// PodGPUs returns the UUIDs of the GPUs (or MIG instances) that pod podUID's
// processes use, sorted, and the GPU memory they use in all.
func PodGPUs(gpus []GPU, podUID string) (uuids []string, usedBytes uint64) {
	for _, g := range gpus {
		for _, p := range g.Processes {
			if p.PodUID != podUID || podUID == "" {
				continue
			}
			usedBytes += p.UsedMemoryBytes
			id := g.UUID
			if p.MIG != "" {
				id = p.MIG
			}
			if !slices.Contains(uuids, id) {
				uuids = append(uuids, id)
			}
		}
	}
	slices.Sort(uuids)
	return uuids, usedBytes
}
