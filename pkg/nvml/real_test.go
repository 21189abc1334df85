package nvml_test

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/nvml"
)

// TestRealGPU reads a real machine's GPUs through the system's NVML, the
// check the mock machines cannot make: that the real driver answers every
// query the inventory makes. No CI machine has a GPU, so it runs only where
// WEIGHTD_REAL_GPU=1 says there is one (and then fails without a driver).
// With WEIGHTD_REAL_GPU_PID set to a process holding at least 1 GiB of GPU
// memory, it also checks that the process is listed.
func TestRealGPU(t *testing.T) {
	if os.Getenv("WEIGHTD_REAL_GPU") != "1" {
		t.Skip("set WEIGHTD_REAL_GPU=1 on a machine with an NVIDIA GPU and driver")
	}
	inv, err := nvml.Open()
	require.NoError(t, err)
	defer inv.Close()
	gpus, err := inv.GPUs()
	require.NoError(t, err)
	require.NotEmpty(t, gpus)
	for _, g := range gpus {
		t.Logf("GPU %d: %s %s, %d MiB total, %d MiB used, MIG %v, %d processes, errors %q",
			g.Index, g.Name, g.UUID, g.MemoryTotalBytes>>20, g.MemoryUsedBytes>>20, g.MIGEnabled, len(g.Processes), g.Errors)
		assert.Empty(t, g.Errors, "every query the inventory makes is answered")
		assert.True(t, strings.HasPrefix(g.UUID, "GPU-"), "UUID %q", g.UUID)
		assert.Contains(t, g.Name, "NVIDIA")
		assert.Positive(t, g.MemoryTotalBytes)
		assert.LessOrEqual(t, g.MemoryUsedBytes+g.MemoryFreeBytes, g.MemoryTotalBytes, "used + free within total")
		for _, p := range g.Processes {
			t.Logf("  process %d: %d MiB, pod %q container %q", p.PID, p.UsedMemoryBytes>>20, p.PodUID, p.ContainerID)
		}
	}
	if s := os.Getenv("WEIGHTD_REAL_GPU_PID"); s != "" {
		pid, err := strconv.Atoi(s)
		require.NoError(t, err)
		found := false
		for _, g := range gpus {
			for _, p := range g.Processes {
				if p.PID == pid {
					found = true
					assert.GreaterOrEqual(t, p.UsedMemoryBytes, gib, "process %d's memory", pid)
				}
			}
		}
		assert.True(t, found, "process %d holds GPU memory but is not listed", pid)
	}

	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, nvml.RegisterMetrics(reg, inv))
	n, err := testutil.GatherAndCount(reg, "weightd_gpu_memory_total_bytes")
	require.NoError(t, err)
	assert.Equal(t, len(gpus), n)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP weightd_gpu_available 1 when NVML answers on this node, 0 without a driver or when NVML fails (the agent's log says why).
# TYPE weightd_gpu_available gauge
weightd_gpu_available 1
`), "weightd_gpu_available"))
}
