package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/weightd/weightd/pkg/nvml"
	"github.com/weightd/weightd/pkg/nvml/nvmltest"
)

const gpuTestPod = "8d3f2a1c-5b6e-4c7d-9e0f-1a2b3c4d5e6f"

// gpuMachine is a DGX H100 with a pod's process on GPU 1, a host process
// on GPU 0, MIG on GPU 4 and GPU 7 lost; and a procfs that places the pod's.
func gpuMachine(t *testing.T) (*nvmltest.Machine, string) {
	t.Helper()
	m := nvmltest.NewDGXH100()
	m.SetMemoryUsed(1, 12<<30)
	m.SetProcesses(1, gonvml.ProcessInfo{Pid: 4242, UsedGpuMemory: 10 << 30})
	m.SetProcesses(0, gonvml.ProcessInfo{Pid: 77, UsedGpuMemory: 1 << 30})
	if _, err := m.EnableMIG(4, gonvml.GPU_INSTANCE_PROFILE_2_SLICE); err != nil {
		t.Fatal(err)
	}
	m.LoseGPU(7)
	proc := t.TempDir()
	dir := filepath.Join(proc, "4242")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cg := "0::/kubepods/burstable/pod" + gpuTestPod + "/" + strings.Repeat("ab", 32) + "\n"
	if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cg), 0o644); err != nil {
		t.Fatal(err)
	}
	return m, proc
}

func runGPUs(t *testing.T, c *gpusCmd) (string, error) {
	t.Helper()
	var out bytes.Buffer
	err := c.Run(&env{ctx: t.Context(), stdout: &out, stderr: &out})
	return out.String(), err
}

func TestGPUsTable(t *testing.T) {
	t.Parallel()
	m, proc := gpuMachine(t)
	out, err := runGPUs(t, &gpusCmd{ProcRoot: proc, lib: m})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out)
	uuid1 := m.Device(1).UUID
	for _, want := range []string{
		"GPU  NAME",
		"NVIDIA H100 80GB HBM3",
		uuid1,
		"12288MiB / 81920MiB",
		"1    4242  10240MiB  " + gpuTestPod + "  -",
		"0    77    1024MiB   -",
		"1 instances",
		"4    0   0   1        MIG-",
		"7    handle: ERROR_GPU_IS_LOST",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "NVIDIA H100 80GB HBM3"); n != 7 {
		t.Errorf("%d GPUs named, want 7 (GPU 7 is lost):\n%s", n, out)
	}
}

func TestGPUsJSON(t *testing.T) {
	t.Parallel()
	m, proc := gpuMachine(t)
	out, err := runGPUs(t, &gpusCmd{JSON: true, ProcRoot: proc, lib: m})
	if err != nil {
		t.Fatal(err)
	}
	var gpus []nvml.GPU
	if err := json.Unmarshal([]byte(out), &gpus); err != nil {
		t.Fatalf("%v:\n%s", err, out)
	}
	if len(gpus) != 8 {
		t.Fatalf("%d GPUs, want 8", len(gpus))
	}
	g := gpus[1]
	if g.UUID != m.Device(1).UUID || g.MemoryUsedBytes != 12<<30 || g.MemoryTotalBytes != 80<<30 {
		t.Errorf("GPU 1 = %+v", g)
	}
	if len(g.Processes) != 1 || g.Processes[0].PodUID != gpuTestPod || g.Processes[0].UsedMemoryBytes != 10<<30 {
		t.Errorf("GPU 1 processes = %+v", g.Processes)
	}
	if !gpus[4].MIGEnabled || len(gpus[4].MIG) != 1 {
		t.Errorf("GPU 4 = %+v, want MIG with one instance", gpus[4])
	}
}

func TestGPUsNoDriver(t *testing.T) {
	t.Parallel()
	_, err := runGPUs(t, &gpusCmd{lib: nvmltest.NoDriver()})
	if err == nil || !strings.Contains(err.Error(), "no NVIDIA driver") {
		t.Fatalf("err = %v, want one saying there is no driver", err)
	}
}

func TestGPUsCommandLine(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runCLI(t, "gpus", "--help")
	if code != 0 || !strings.Contains(stdout, "--json") || !strings.Contains(stdout, "--proc-root") {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
}
