package p2p

import "github.com/prometheus/client_golang/prometheus"

// membershipMetrics are a Membership's collectors, registered on
// MembershipConfig.Registerer when there is one.
type membershipMetrics struct {
	peers    prometheus.Gauge
	messages *prometheus.CounterVec
	dropped  prometheus.Counter
}

func newMembershipMetrics(r prometheus.Registerer) (*membershipMetrics, error) {
	m := &membershipMetrics{
		peers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_p2p_peers", Help: "Live members of the weightd cluster, not counting this node.",
		}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_p2p_gossip_messages_total",
			Help: "Gossip received and decoded: holding events by kind (complete, partial, dropped), and push/pull states (state).",
		}, []string{"kind"}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_p2p_gossip_dropped_total",
			Help: "Gossip messages and push/pull states received malformed or about nodes that are no members, and queued events dropped because the broadcast queue was full.",
		}),
	}
	for _, kind := range []EventKind{EventComplete, EventPartial, EventDropped} {
		m.messages.WithLabelValues(kind.String())
	}
	m.messages.WithLabelValues("state")
	if r == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.peers, m.messages, m.dropped} {
		if err := r.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
