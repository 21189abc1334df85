package policy

import "github.com/prometheus/client_golang/prometheus"

// metrics are the controller's Prometheus collectors.
type metrics struct {
	writes   *prometheus.CounterVec
	selected prometheus.Gauge
	pinned   prometheus.Gauge
}

func newMetrics() metrics {
	m := metrics{
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_policy_status_writes_total",
			Help: "Server-side applies to PrefetchPolicy status by this agent: its node's entry (entry), the removal of it (remove), the counts (counts); by outcome (ok, error).",
		}, []string{"kind", "outcome"}),
		selected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_policy_selected",
			Help: "PrefetchPolicies that select this node.",
		}),
		pinned: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_policy_pinned_blobs",
			Help: "Pins held for PrefetchPolicies (a blob pinned by two policies counts twice).",
		}),
	}
	for _, k := range []string{"entry", "remove", "counts"} {
		for _, o := range []string{"ok", "error"} {
			m.writes.WithLabelValues(k, o)
		}
	}
	return m
}

func (m metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.writes, m.selected, m.pinned}
}

// register registers the collectors on r (nil: none) and returns how to
// unregister them.
func (m metrics) register(r prometheus.Registerer) (unregister func(), err error) {
	if r == nil {
		return func() {}, nil
	}
	cs := m.collectors()
	for i, c := range cs {
		if err := r.Register(c); err != nil {
			for _, c := range cs[:i] {
				r.Unregister(c)
			}
			return nil, err
		}
	}
	return func() {
		for _, c := range cs {
			r.Unregister(c)
		}
	}, nil
}
