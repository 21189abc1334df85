// Package nvmltest is a fake NVML for tests: go-nvml's mock DGX H100 and
// H200 machines (8 GPUs each), with what those mocks leave out filled in —
// used memory, compute processes, MIG device handles — and faults to
// inject: a GPU lost, a GPU that will not list its processes, no driver.
package nvmltest

import (
	"fmt"
	"sync"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// Machine is a fake node's NVML: an nvml.Interface. Its setters may be
// called while it is read.
type Machine struct {
	*server.Server

	mu   sync.Mutex
	gpus []*gpu
}

// gpu is what the fake adds to a mock device.
type gpu struct {
	used    uint64
	procs   []gonvml.ProcessInfo
	procErr gonvml.Return
	lost    bool
	mig     []*migDevice
}

// migDevice is one MIG device handle: a compute instance of a GPU instance.
type migDevice struct {
	mock.Device
	uuid   string
	gi, ci int
	total  uint64
}

// NewDGXH100 returns a DGX H100: 8 × NVIDIA H100 80GB HBM3.
func NewDGXH100() *Machine { return wrap(dgxh100.New()) }

// NewDGXH200 returns a DGX H200: 8 × NVIDIA H200 141GB HBM3e.
func NewDGXH200() *Machine { return wrap(dgxh200.New()) }

// NoDriver returns an nvml.Interface whose Init fails as go-nvml's does on a
// node without libnvidia-ml.so.1.
func NoDriver() gonvml.Interface {
	return &mock.Interface{InitFunc: func() gonvml.Return { return gonvml.ERROR_LIBRARY_NOT_FOUND }}
}

func wrap(s *server.Server) *Machine {
	m := &Machine{Server: s, gpus: make([]*gpu, len(s.Devices))}
	for i := range s.Devices {
		m.gpus[i] = &gpu{procErr: gonvml.SUCCESS}
		m.fill(i)
	}
	byIndex := s.DeviceGetHandleByIndexFunc
	s.DeviceGetHandleByIndexFunc = func(i int) (gonvml.Device, gonvml.Return) {
		m.mu.Lock()
		lost := i >= 0 && i < len(m.gpus) && m.gpus[i].lost
		m.mu.Unlock()
		if lost {
			return nil, gonvml.ERROR_GPU_IS_LOST
		}
		return byIndex(i)
	}
	return m
}

// Device returns GPU i's mock device.
func (m *Machine) Device(i int) *server.Device {
	return m.Devices[i].(*server.Device)
}

// fill sets the functions the mock leaves nil, or answers without used
// memory, on GPU i.
func (m *Machine) fill(i int) {
	d := m.Device(i)
	g := m.gpus[i]
	d.GetMemoryInfoFunc = func() (gonvml.Memory, gonvml.Return) {
		m.mu.Lock()
		defer m.mu.Unlock()
		total := d.MemoryInfo.Total
		return gonvml.Memory{Total: total, Used: g.used, Free: total - g.used}, gonvml.SUCCESS
	}
	d.GetMemoryInfo_v2Func = func() (gonvml.Memory_v2, gonvml.Return) {
		m.mu.Lock()
		defer m.mu.Unlock()
		total := d.MemoryInfo.Total
		return gonvml.Memory_v2{Total: total, Used: g.used, Free: total - g.used}, gonvml.SUCCESS
	}
	d.GetComputeRunningProcessesFunc = func() ([]gonvml.ProcessInfo, gonvml.Return) {
		m.mu.Lock()
		defer m.mu.Unlock()
		if g.procErr != gonvml.SUCCESS {
			return nil, g.procErr
		}
		return append([]gonvml.ProcessInfo(nil), g.procs...), gonvml.SUCCESS
	}
	d.GetMaxMigDeviceCountFunc = func() (int, gonvml.Return) {
		return 7, gonvml.SUCCESS
	}
	d.GetMigDeviceHandleByIndexFunc = func(n int) (gonvml.Device, gonvml.Return) {
		m.mu.Lock()
		defer m.mu.Unlock()
		if n < 0 || n >= len(g.mig) {
			return nil, gonvml.ERROR_NOT_FOUND
		}
		return g.mig[n], gonvml.SUCCESS
	}
	d.GetGpuInstanceByIdFunc = func(id int) (gonvml.GpuInstance, gonvml.Return) {
		d.RLock()
		defer d.RUnlock()
		for gi := range d.GpuInstances {
			if int(gi.Info.Id) == id {
				return gi, gonvml.SUCCESS
			}
		}
		return nil, gonvml.ERROR_NOT_FOUND
	}
}

// SetMemoryUsed sets how much memory GPU i has in use.
func (m *Machine) SetMemoryUsed(i int, used uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.gpus[i].used = used
}

// SetProcesses sets the compute processes on GPU i. On a GPU with MIG
// enabled each process runs on the MIG device of its GpuInstanceId and
// ComputeInstanceId, and only that device lists it.
func (m *Machine) SetProcesses(i int, procs ...gonvml.ProcessInfo) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.gpus[i].procs = procs
}

// FailProcesses makes GPU i's (and its MIG devices') process listing fail
// with ret, as ERROR_NOT_SUPPORTED does on some GPUs; SUCCESS undoes it.
func (m *Machine) FailProcesses(i int, ret gonvml.Return) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.gpus[i].procErr = ret
}

// LoseGPU makes GPU i fall off the bus: its handle fails with
// ERROR_GPU_IS_LOST.
func (m *Machine) LoseGPU(i int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.gpus[i].lost = true
}

// EnableMIG turns MIG on for GPU i and creates one GPU instance per profile
// (nvml.GPU_INSTANCE_PROFILE_*), each with one compute instance spanning
// it, and returns the new MIG devices' UUIDs in order.
func (m *Machine) EnableMIG(i int, profiles ...int) ([]string, error) {
	d := m.Device(i)
	if ret, _ := d.SetMigMode(gonvml.DEVICE_MIG_ENABLE); ret != gonvml.SUCCESS {
		return nil, fmt.Errorf("enabling MIG on GPU %d: %w", i, ret)
	}
	var uuids []string
	for _, p := range profiles {
		info, ret := d.GetGpuInstanceProfileInfo(p)
		if ret != gonvml.SUCCESS {
			return nil, fmt.Errorf("GPU instance profile %d: %w", p, ret)
		}
		gi, ret := d.CreateGpuInstance(&info)
		if ret != gonvml.SUCCESS {
			return nil, fmt.Errorf("creating GPU instance of profile %d: %w", p, ret)
		}
		ciInfo, err := fullComputeProfile(gi, info.SliceCount)
		if err != nil {
			return nil, err
		}
		ci, ret := gi.CreateComputeInstance(&ciInfo)
		if ret != gonvml.SUCCESS {
			return nil, fmt.Errorf("creating compute instance: %w", ret)
		}
		giInfo, _ := gi.GetInfo()
		cInfo, _ := ci.GetInfo()
		md := m.newMIGDevice(i, int(giInfo.Id), int(cInfo.Id), uint64(info.MemorySizeMB)<<20)
		uuids = append(uuids, md.uuid)
	}
	return uuids, nil
}

// fullComputeProfile returns the compute instance profile of gi that spans
// all its slices.
func fullComputeProfile(gi gonvml.GpuInstance, slices uint32) (gonvml.ComputeInstanceProfileInfo, error) {
	for id := range gonvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(id, gonvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret == gonvml.SUCCESS && info.SliceCount == slices {
			return info, nil
		}
	}
	return gonvml.ComputeInstanceProfileInfo{}, fmt.Errorf("no compute instance profile of %d slices", slices)
}

// newMIGDevice adds a MIG device handle to GPU i. Its processes are GPU i's
// whose instance IDs match, and its used memory is theirs.
func (m *Machine) newMIGDevice(i, giID, ciID int, total uint64) *migDevice {
	m.mu.Lock()
	defer m.mu.Unlock()
	g := m.gpus[i]
	md := &migDevice{
		uuid:  fmt.Sprintf("MIG-%08x-0000-4000-8000-%04x%08x", i, giID, ciID),
		gi:    giID,
		ci:    ciID,
		total: total,
	}
	procs := func() []gonvml.ProcessInfo {
		var out []gonvml.ProcessInfo
		for _, p := range g.procs {
			if int(p.GpuInstanceId) == giID && int(p.ComputeInstanceId) == ciID {
				out = append(out, p)
			}
		}
		return out
	}
	md.GetUUIDFunc = func() (string, gonvml.Return) { return md.uuid, gonvml.SUCCESS }
	md.GetGpuInstanceIdFunc = func() (int, gonvml.Return) { return md.gi, gonvml.SUCCESS }
	md.GetComputeInstanceIdFunc = func() (int, gonvml.Return) { return md.ci, gonvml.SUCCESS }
	md.GetDeviceHandleFromMigDeviceHandleFunc = func() (gonvml.Device, gonvml.Return) { return m.Devices[i], gonvml.SUCCESS }
	md.GetMemoryInfo_v2Func = func() (gonvml.Memory_v2, gonvml.Return) {
		m.mu.Lock()
		defer m.mu.Unlock()
		var used uint64
		for _, p := range procs() {
			used += p.UsedGpuMemory
		}
		return gonvml.Memory_v2{Total: md.total, Used: used, Free: md.total - used}, gonvml.SUCCESS
	}
	md.GetComputeRunningProcessesFunc = func() ([]gonvml.ProcessInfo, gonvml.Return) {
		m.mu.Lock()
		defer m.mu.Unlock()
		if g.procErr != gonvml.SUCCESS {
			return nil, g.procErr
		}
		return procs(), gonvml.SUCCESS
	}
	g.mig = append(g.mig, md)
	return md
}
