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
			Help: "Writes of this node's PrefetchPolicy status by this agent: its PrefetchPolicyNode applied (entry) or deleted (remove); by outcome (ok, error).",
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
	for _, k := range []string{"entry", "remove"} {
		for _, o := range []string{"ok", "error"} {
			m.writes.WithLabelValues(k, o)
		}
	}
	return m
}

func (m metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.writes, m.selected, m.pinned}
}

// summaryMetrics are the Summarizer's collectors.
type summaryMetrics struct {
	writes    *prometheus.CounterVec
	leader    prometheus.Gauge
	candidate prometheus.Gauge
}

func newSummaryMetrics() summaryMetrics {
	m := summaryMetrics{
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_policy_summary_writes_total",
			Help: "Server-side applies of PrefetchPolicy status counts by this agent while elected to summarise; by outcome (ok, error).",
		}, []string{"outcome"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_policy_summary_leader",
			Help: "1 while this agent holds the Lease that elects the one summarising PrefetchPolicy status, else 0.",
		}),
		candidate: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_policy_summary_candidate",
			Help: "1 while this agent campaigns for the Lease of the PrefetchPolicy status summary or holds it, else 0; with gossip, three agents are candidates.",
		}),
	}
	for _, o := range []string{"ok", "error"} {
		m.writes.WithLabelValues(o)
	}
	return m
}

func (m summaryMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.writes, m.leader, m.candidate}
}

// register registers cs on r (nil: none) and returns how to unregister
// them.
func register(r prometheus.Registerer, cs []prometheus.Collector) (unregister func(), err error) {
	if r == nil {
		return func() {}, nil
	}
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
