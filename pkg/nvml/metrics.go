package nvml

import (
	"fmt"
	"log/slog"
	"strconv"
	"sync"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"
)

// Metric descriptions. The gpu label is the GPU's index: bounded by the
// node's GPU count.
var (
	availableDesc = prometheus.NewDesc("weightd_gpu_available",
		"1 when NVML answers on this node, 0 without a driver or when NVML fails (the agent's log says why).",
		nil, nil)
	memoryTotalDesc = prometheus.NewDesc("weightd_gpu_memory_total_bytes",
		"Memory of each GPU, by index.", []string{"gpu"}, nil)
	memoryUsedDesc = prometheus.NewDesc("weightd_gpu_memory_used_bytes",
		"Memory in use on each GPU, by index, as nvidia-smi counts it.", []string{"gpu"}, nil)
)

// RegisterMetrics registers the GPU metrics of inv on r. inv may be nil (no
// driver): weightd_gpu_available is then 0. The metrics are read from NVML
// at scrape time, so they are as fresh as the scrape and cost nothing
// between scrapes (one NVML query per GPU per scrape, no process listing).
// When a scrape's read fails, or works again, the inventory's logger says so
// once.
func RegisterMetrics(r prometheus.Registerer, inv *Inventory) error {
	return r.Register(&collector{inv: inv})
}

type collector struct {
	inv *Inventory

	mu      sync.Mutex
	lastErr string // the failure last logged, "" when the last read worked
}

// Describe implements prometheus.Collector.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- availableDesc
	ch <- memoryTotalDesc
	ch <- memoryUsedDesc
}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	if c.inv == nil {
		ch <- prometheus.MustNewConstMetric(availableDesc, prometheus.GaugeValue, 0)
		return
	}
	err := c.inv.memory(ch)
	c.noteErr(c.inv.log, err)
	available := 1.0
	if err != nil {
		available = 0
	}
	ch <- prometheus.MustNewConstMetric(availableDesc, prometheus.GaugeValue, available)
}

// noteErr logs a scrape's failure when it differs from the last one, and the
// recovery after one.
func (c *collector) noteErr(log *slog.Logger, err error) {
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if msg == c.lastErr {
		return
	}
	if err != nil {
		log.Warn("GPU metrics unavailable", "err", err)
	} else {
		log.Info("GPU metrics available again")
	}
	c.lastErr = msg
}

// memory sends each GPU's memory metrics. Only the device count's failure
// is an error: a GPU that fails is left out.
func (i *Inventory) memory(ch chan<- prometheus.Metric) error {
	n, ret := i.lib.DeviceGetCount()
	if ret != gonvml.SUCCESS {
		return fmt.Errorf("counting GPUs: %w", ret)
	}
	for idx := range n {
		d, ret := i.lib.DeviceGetHandleByIndex(idx)
		if ret != gonvml.SUCCESS {
			continue
		}
		total, used, _, ret := memory(d)
		if ret != gonvml.SUCCESS {
			continue
		}
		gpu := strconv.Itoa(idx)
		ch <- prometheus.MustNewConstMetric(memoryTotalDesc, prometheus.GaugeValue, float64(total), gpu)
		ch <- prometheus.MustNewConstMetric(memoryUsedDesc, prometheus.GaugeValue, float64(used), gpu)
	}
	return nil
}
