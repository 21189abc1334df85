package nvml_test

import (
	"bytes"
	"log/slog"
	"slices"
	"strings"
	"testing"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/nvml"
	"github.com/weightd/weightd/pkg/nvml/nvmltest"
)

func TestAPIGPUs(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if got := nvml.APIGPUs(nil, nil, log)(); got != nil {
		t.Errorf("GPUs without a driver: %+v", got)
	}

	m := nvmltest.NewDGXH100()
	m.SetMemoryUsed(1, 12<<30)
	inv, err := nvml.New(m, nvml.WithLogger(log), nvml.WithProcRoot(t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	defer inv.Close()
	uuid := m.Device(1).UUID
	servers := func() []api.WarmServer {
		return []api.WarmServer{
			{Pod: "ai/a", Base: "hf://org/base@main", Healthy: true, GPUs: []string{uuid}},
			{Pod: "ai/b", Base: "hf://org/base@main", Healthy: true, GPUs: []string{uuid}},
			{Pod: "ai/c", Base: "hf://org/other@main", Healthy: false, GPUs: []string{uuid}},
		}
	}
	got := nvml.APIGPUs(inv, servers, log)()
	if len(got) != 8 {
		t.Fatalf("%d GPUs, want 8", len(got))
	}
	want := api.GPU{Index: 1, UUID: m.Device(1).UUID, Name: "NVIDIA H100 80GB HBM3", MemoryTotalBytes: 80 << 30, MemoryUsedBytes: 12 << 30}
	if g := got[1]; g.Index != want.Index || g.UUID != want.UUID || g.Name != want.Name ||
		g.MemoryTotalBytes != want.MemoryTotalBytes || g.MemoryUsedBytes != want.MemoryUsedBytes {
		t.Errorf("GPU 1 = %+v, want %+v", g, want)
	}
	// The healthy servers' base, once; the unhealthy server's not.
	if !slices.Equal(got[1].Bases, []string{"hf://org/base@main"}) || got[0].Bases != nil {
		t.Errorf("warm bases: GPU 1 %v, GPU 0 %v", got[1].Bases, got[0].Bases)
	}

	m.DeviceGetCountFunc = func() (int, gonvml.Return) { return 0, gonvml.ERROR_UNKNOWN }
	if got := nvml.APIGPUs(inv, nil, log)(); got != nil {
		t.Errorf("GPUs when NVML fails: %+v", got)
	}
	if !strings.Contains(logs.String(), "reading GPUs") {
		t.Errorf("log:\n%s", logs.String())
	}
}
