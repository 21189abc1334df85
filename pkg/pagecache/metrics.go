package pagecache

import "github.com/prometheus/client_golang/prometheus"

// File states of weightd_dram_tier_files.
const (
	stateKept       = "kept"
	stateOverBudget = "over_budget"
	stateFailed     = "failed"
)

type metrics struct {
	budget, kept, resident, locked, mlockAvailable prometheus.Gauge
	files                                          *prometheus.GaugeVec
	rewarmed                                       prometheus.Counter
}

func newMetrics(r prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		budget: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_dram_tier_budget_bytes", Help: "Memory budget of the DRAM tier in bytes.",
		}),
		kept: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_dram_tier_kept_bytes", Help: "Bytes of the files the DRAM tier keeps (within its budget; a file kept by several owners counts once).",
		}),
		resident: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_dram_tier_resident_bytes", Help: "Bytes of the kept files found in the page cache at the last check.",
		}),
		locked: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_dram_tier_locked_bytes", Help: "Bytes of the kept files locked in memory with mlock.",
		}),
		mlockAvailable: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_dram_tier_mlock_available", Help: "1 while the DRAM tier may lock files in memory, 0 once the kernel refused (or mlock is off): files are then kept by re-warming.",
		}),
		files: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weightd_dram_tier_files", Help: "Files asked of the DRAM tier, by state: kept, over_budget, failed (gone, changed or unreadable).",
		}, []string{"state"}),
		rewarmed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_dram_tier_rewarmed_bytes_total", Help: "Bytes the DRAM tier read back into the page cache after they were not resident.",
		}),
	}
	for _, s := range []string{stateKept, stateOverBudget, stateFailed} {
		m.files.WithLabelValues(s)
	}
	if r == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.budget, m.kept, m.resident, m.locked, m.mlockAvailable, m.files, m.rewarmed} {
		if err := r.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
