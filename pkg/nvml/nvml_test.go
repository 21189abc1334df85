package nvml_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/nvml"
	"github.com/weightd/weightd/pkg/nvml/nvmltest"
)

const (
	podA = "8d3f2a1c-5b6e-4c7d-9e0f-1a2b3c4d5e6f"
	podB = "0a1b2c3d-4e5f-4a7b-8c9d-0e1f2a3b4c5d"
	ctrA = "4f1e9c0b7a2d3e5f6a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f"
	gib  = uint64(1) << 30
)

// procfs writes a fake procfs under a temp dir with a cgroup file per pid.
func procfs(t *testing.T, cgroups map[int]string) string {
	t.Helper()
	root := t.TempDir()
	for pid, cg := range cgroups {
		dir := filepath.Join(root, strconv.Itoa(pid))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte("0::"+cg+"\n"), 0o644))
	}
	return root
}

func systemdCgroup(uid, ctr string) string {
	return "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" +
		strings.ReplaceAll(uid, "-", "_") + ".slice/cri-containerd-" + ctr + ".scope"
}

func TestGPUsOnMockMachines(t *testing.T) {
	t.Parallel()
	tests := []struct {
		machine string
		new     func() *nvmltest.Machine
		name    string
		total   uint64
	}{
		{"dgxh100", nvmltest.NewDGXH100, "NVIDIA H100 80GB HBM3", 81920 << 20},
		{"dgxh200", nvmltest.NewDGXH200, "NVIDIA H200 141GB HBM3e", 144384 << 20},
	}
	for _, tt := range tests {
		t.Run(tt.machine, func(t *testing.T) {
			t.Parallel()
			m := tt.new()
			m.SetMemoryUsed(3, 7*gib)
			m.SetProcesses(3,
				gonvml.ProcessInfo{Pid: 200, UsedGpuMemory: 5 * gib},
				gonvml.ProcessInfo{Pid: 100, UsedGpuMemory: 2 * gib},
				gonvml.ProcessInfo{Pid: 300, UsedGpuMemory: gib}, // exited since
			)
			m.SetProcesses(4, gonvml.ProcessInfo{Pid: 400, UsedGpuMemory: 3 * gib})
			proc := procfs(t, map[int]string{
				100: systemdCgroup(podA, ctrA),
				200: "/system.slice/host-inference.service",
				400: "/kubepods/besteffort/pod" + podB + "/" + ctrA,
			})
			inv, err := nvml.New(m, nvml.WithProcRoot(proc))
			require.NoError(t, err)
			t.Cleanup(func() { assert.NoError(t, inv.Close()) })

			gpus, err := inv.GPUs()
			require.NoError(t, err)
			require.Len(t, gpus, 8)
			seen := map[string]bool{}
			for i, g := range gpus {
				assert.Equal(t, i, g.Index)
				assert.Equal(t, tt.name, g.Name)
				assert.True(t, strings.HasPrefix(g.UUID, "GPU-"), g.UUID)
				assert.False(t, seen[g.UUID], "UUID %s twice", g.UUID)
				seen[g.UUID] = true
				assert.Equal(t, tt.total, g.MemoryTotalBytes)
				assert.Equal(t, g.MemoryTotalBytes, g.MemoryUsedBytes+g.MemoryFreeBytes)
				assert.False(t, g.MIGEnabled)
				assert.Empty(t, g.Errors)
			}
			assert.Equal(t, 7*gib, gpus[3].MemoryUsedBytes)
			assert.Equal(t, []nvml.Process{
				{PID: 100, UsedMemoryBytes: 2 * gib, PodUID: podA, ContainerID: ctrA},
				{PID: 200, UsedMemoryBytes: 5 * gib},
				{PID: 300, UsedMemoryBytes: gib},
			}, gpus[3].Processes)
			assert.Equal(t, []nvml.Process{{PID: 400, UsedMemoryBytes: 3 * gib, PodUID: podB, ContainerID: ctrA}}, gpus[4].Processes)
			assert.Empty(t, gpus[0].Processes)

			uuids, used := nvml.PodGPUs(gpus, podA)
			assert.Equal(t, []string{gpus[3].UUID}, uuids)
			assert.Equal(t, 2*gib, used)
			uuids, used = nvml.PodGPUs(gpus, "")
			assert.Empty(t, uuids)
			assert.Zero(t, used)
		})
	}
}

func TestMIG(t *testing.T) {
	t.Parallel()
	m := nvmltest.NewDGXH100()
	migs, err := m.EnableMIG(2, gonvml.GPU_INSTANCE_PROFILE_3_SLICE, gonvml.GPU_INSTANCE_PROFILE_1_SLICE)
	require.NoError(t, err)
	require.Len(t, migs, 2)
	// Pod A runs on the 3g instance (GI 0) and the 1g one (GI 1); a host
	// process on the 1g one too.
	m.SetProcesses(2,
		gonvml.ProcessInfo{Pid: 10, UsedGpuMemory: 20 * gib, GpuInstanceId: 0, ComputeInstanceId: 0},
		gonvml.ProcessInfo{Pid: 11, UsedGpuMemory: 4 * gib, GpuInstanceId: 1, ComputeInstanceId: 0},
		gonvml.ProcessInfo{Pid: 12, UsedGpuMemory: gib, GpuInstanceId: 1, ComputeInstanceId: 0},
	)
	proc := procfs(t, map[int]string{10: systemdCgroup(podA, ctrA), 11: systemdCgroup(podA, ctrA)})
	inv, err := nvml.New(m, nvml.WithProcRoot(proc))
	require.NoError(t, err)

	gpus, err := inv.GPUs()
	require.NoError(t, err)
	g := gpus[2]
	assert.Empty(t, g.Errors)
	assert.True(t, g.MIGEnabled)
	assert.Equal(t, []nvml.MIGInstance{
		{UUID: migs[0], GPUInstanceID: 0, ComputeInstanceID: 0, ProfileID: gonvml.GPU_INSTANCE_PROFILE_3_SLICE,
			MemoryTotalBytes: 40 * gib, MemoryUsedBytes: 20 * gib},
		{UUID: migs[1], GPUInstanceID: 1, ComputeInstanceID: 0, ProfileID: gonvml.GPU_INSTANCE_PROFILE_1_SLICE,
			MemoryTotalBytes: 10 * gib, MemoryUsedBytes: 5 * gib},
	}, g.MIG)
	assert.Equal(t, []nvml.Process{
		{PID: 10, UsedMemoryBytes: 20 * gib, MIG: migs[0], PodUID: podA, ContainerID: ctrA},
		{PID: 11, UsedMemoryBytes: 4 * gib, MIG: migs[1], PodUID: podA, ContainerID: ctrA},
		{PID: 12, UsedMemoryBytes: gib, MIG: migs[1]},
	}, g.Processes)
	for i, other := range gpus {
		if i != 2 {
			assert.False(t, other.MIGEnabled)
			assert.Empty(t, other.MIG)
		}
	}

	uuids, used := nvml.PodGPUs(gpus, podA)
	want := []string{migs[0], migs[1]}
	if want[0] > want[1] {
		want[0], want[1] = want[1], want[0]
	}
	assert.Equal(t, want, uuids)
	assert.Equal(t, 24*gib, used)
}

func TestDeviceErrors(t *testing.T) {
	t.Parallel()
	m := nvmltest.NewDGXH200()
	m.FailProcesses(1, gonvml.ERROR_NOT_SUPPORTED)
	m.LoseGPU(5)
	_, err := m.EnableMIG(6, gonvml.GPU_INSTANCE_PROFILE_7_SLICE)
	require.NoError(t, err)
	m.FailProcesses(6, gonvml.ERROR_NO_PERMISSION)
	m.SetProcesses(0, gonvml.ProcessInfo{Pid: 1, UsedGpuMemory: gib})
	inv, err := nvml.New(m, nvml.WithProcRoot(t.TempDir()))
	require.NoError(t, err)

	gpus, err := inv.GPUs()
	require.NoError(t, err)
	require.Len(t, gpus, 8)
	assert.Equal(t, []string{"processes: ERROR_NOT_SUPPORTED"}, gpus[1].Errors)
	assert.NotEmpty(t, gpus[1].UUID)
	assert.NotZero(t, gpus[1].MemoryTotalBytes)
	assert.Equal(t, nvml.GPU{Index: 5, Errors: []string{"handle: ERROR_GPU_IS_LOST"}}, gpus[5])
	assert.Equal(t, []string{"mig device 0 processes: ERROR_NO_PERMISSION"}, gpus[6].Errors)
	assert.Len(t, gpus[6].MIG, 1)
	assert.Equal(t, []nvml.Process{{PID: 1, UsedMemoryBytes: gib}}, gpus[0].Processes)
	for _, i := range []int{0, 2, 3, 4, 7} {
		assert.Empty(t, gpus[i].Errors, "GPU %d", i)
	}

	// A device count that fails fails the whole read.
	m.DeviceGetCountFunc = func() (int, gonvml.Return) { return 0, gonvml.ERROR_UNKNOWN }
	_, err = inv.GPUs()
	require.ErrorIs(t, err, gonvml.ERROR_UNKNOWN)
}

func TestNoDriver(t *testing.T) {
	t.Parallel()
	_, err := nvml.New(nvmltest.NoDriver())
	require.ErrorIs(t, err, nvml.ErrNoDriver)
	require.ErrorIs(t, err, gonvml.ERROR_LIBRARY_NOT_FOUND)
}

func TestMetrics(t *testing.T) {
	t.Parallel()
	m := nvmltest.NewDGXH100()
	m.SetMemoryUsed(0, 3*gib)
	m.LoseGPU(7)
	inv, err := nvml.New(m)
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, nvml.RegisterMetrics(reg, inv))

	var want strings.Builder
	want.WriteString(`
# HELP weightd_gpu_available 1 when NVML answers on this node, 0 without a driver or when NVML fails (the agent's log says why).
# TYPE weightd_gpu_available gauge
weightd_gpu_available 1
# HELP weightd_gpu_memory_total_bytes Memory of each GPU, by index.
# TYPE weightd_gpu_memory_total_bytes gauge
`)
	for i := range 7 {
		want.WriteString("weightd_gpu_memory_total_bytes{gpu=\"" + strconv.Itoa(i) + "\"} 8.589934592e+10\n")
	}
	want.WriteString(`# HELP weightd_gpu_memory_used_bytes Memory in use on each GPU, by index, as nvidia-smi counts it.
# TYPE weightd_gpu_memory_used_bytes gauge
weightd_gpu_memory_used_bytes{gpu="0"} 3.221225472e+09
`)
	for i := 1; i < 7; i++ {
		want.WriteString("weightd_gpu_memory_used_bytes{gpu=\"" + strconv.Itoa(i) + "\"} 0\n")
	}
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want.String())))

	m.DeviceGetCountFunc = func() (int, gonvml.Return) { return 0, gonvml.ERROR_UNKNOWN }
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP weightd_gpu_available 1 when NVML answers on this node, 0 without a driver or when NVML fails (the agent's log says why).
# TYPE weightd_gpu_available gauge
weightd_gpu_available 0
`)))
}

func TestMetricsWithoutDriver(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, nvml.RegisterMetrics(reg, nil))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP weightd_gpu_available 1 when NVML answers on this node, 0 without a driver or when NVML fails (the agent's log says why).
# TYPE weightd_gpu_available gauge
weightd_gpu_available 0
`)))
}
