package mirror

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Outcomes of a request, the values of the outcome label.
const (
	outcomeHit      = "hit"               // served from the cache
	outcomeMiss     = "miss"              // fetched upstream (or from peers)
	outcomeFallback = "upstream_fallback" // the upstream failed; a tag served from its last known manifest
	outcomeNotFound = "not_found"
	outcomeDenied   = "denied" // the registry refused the client
	outcomeError    = "error"
)

type metrics struct {
	requests *prometheus.CounterVec
	bytes    *prometheus.CounterVec
}

func newMetrics(r prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_mirror_requests_total",
			Help: "Registry mirror requests by kind (manifest, blob) and outcome (hit, miss, upstream_fallback, not_found, denied, error).",
		}, []string{"kind", "outcome"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_mirror_bytes_total",
			Help: "Bytes the registry mirror sent, by source: cache (complete blobs) or fetch (streamed while being fetched).",
		}, []string{"source"}),
	}
	for _, k := range []string{"manifest", "blob"} {
		for _, o := range []string{outcomeHit, outcomeMiss, outcomeFallback, outcomeNotFound, outcomeDenied, outcomeError} {
			m.requests.WithLabelValues(k, o)
		}
	}
	m.bytes.WithLabelValues("cache")
	m.bytes.WithLabelValues("fetch")
	if r != nil {
		for _, c := range []prometheus.Collector{m.requests, m.bytes} {
			if err := r.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *metrics) request(k routeKind, outcome string) {
	kind := "blob"
	if k == routeManifest {
		kind = "manifest"
	}
	m.requests.WithLabelValues(kind, outcome).Inc()
}
