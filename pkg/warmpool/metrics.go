package warmpool

import "github.com/prometheus/client_golang/prometheus"

// Outcomes of an adapter load, the outcome label of
// weightd_warmpool_adapter_loads_total.
const (
	outcomeOK          = "ok"
	outcomeRejected    = "rejected"    // the runtime refused the adapter
	outcomeUnavailable = "unavailable" // timeout, 5xx, connection refused or reset
	outcomeUnlisted    = "unlisted"    // success claimed, adapter not listed
	outcomeError       = "error"       // staging or anything else
)

type metrics struct {
	servers    *prometheus.GaugeVec     // runtime, state
	loads      *prometheus.CounterVec   // runtime, outcome
	evictions  *prometheus.CounterVec   // runtime
	reloads    *prometheus.CounterVec   // runtime
	swap       *prometheus.HistogramVec // runtime
	slots      *prometheus.GaugeVec     // state
	baseMemory *prometheus.GaugeVec     // base
}

func newMetrics(r prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		servers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weightd_warmpool_servers", Help: "Warm servers on this node, by runtime and health (healthy or unhealthy).",
		}, []string{"runtime", "state"}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_warmpool_adapter_loads_total", Help: "Adapter loads asked of warm servers, by runtime and outcome (ok, rejected, unavailable, unlisted, error).",
		}, []string{"runtime", "outcome"}),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_warmpool_adapter_evictions_total", Help: "Adapters unloaded to free a slot.",
		}, []string{"runtime"}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_warmpool_adapter_reloads_total", Help: "Adapters in use loaded again after their server lost them (a restart).",
		}, []string{"runtime"}),
		swap: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "weightd_warmpool_adapter_swap_seconds", Help: "Time to make an adapter available when it was not loaded: fetch, check, stage, evict, load and verify.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16), // 1 ms … 33 s
		}, []string{"runtime"}),
		slots: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weightd_warmpool_adapter_slots", Help: "Adapter slots of the warm servers, used (loaded or loading) and free.",
		}, []string{"state"}),
		baseMemory: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weightd_warmpool_base_gpu_memory_bytes", Help: "GPU memory used by the processes of the warm servers of each base model.",
		}, []string{"base"}),
	}
	if r == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.servers, m.loads, m.evictions, m.reloads, m.swap, m.slots, m.baseMemory} {
		if err := r.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
