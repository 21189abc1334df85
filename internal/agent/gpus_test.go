package agent

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/weightd/weightd/pkg/nvml/nvmltest"
)

func TestOpenGPUs(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	if inv := openGPUs(nvmltest.NoDriver(), "/proc", log); inv != nil {
		t.Fatal("an inventory without a driver")
	}
	if !strings.Contains(logs.String(), "GPU features off: no NVIDIA driver") {
		t.Errorf("log:\n%s", logs.String())
	}
	inv := openGPUs(nvmltest.NewDGXH100(), t.TempDir(), log)
	if inv == nil {
		t.Fatal("no inventory")
	}
	inv.Close()
}
