package cache

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	storedBytes          prometheus.Gauge
	storedBlobs          prometheus.Gauge
	partialBytes         prometheus.Gauge
	budgetBytes          prometheus.Gauge
	minFreeBytes         prometheus.Gauge
	hits                 prometheus.Counter
	misses               prometheus.Counter
	evictions            prometheus.Counter
	evictedBytes         prometheus.Counter
	ingestBytes          prometheus.Counter
	ingestSeconds        prometheus.Histogram
	verificationFailures prometheus.Counter
	diskFull             prometheus.Counter
	retries              prometheus.Counter
}

func newMetrics(r prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		storedBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_cache_stored_bytes", Help: "Bytes of complete, verified blobs in the cache.",
		}),
		storedBlobs: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_cache_stored_blobs", Help: "Complete, verified blobs in the cache.",
		}),
		partialBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_cache_partial_bytes", Help: "Bytes reserved by partial downloads.",
		}),
		budgetBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_cache_budget_bytes", Help: "Disk budget of the cache in bytes.",
		}),
		minFreeBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "weightd_cache_min_free_bytes",
			Help: "Free space the cache leaves on its filesystem: it evicts, or refuses a download, rather than go below it.",
		}),
		hits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_hits_total", Help: "Fetches answered by a blob already in the cache.",
		}),
		misses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_misses_total", Help: "Fetches that had to download the blob.",
		}),
		evictions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_evictions_total", Help: "Blobs and idle partial downloads evicted to stay under the budget.",
		}),
		evictedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_evicted_bytes_total", Help: "Bytes evicted to stay under the budget.",
		}),
		ingestBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_ingest_bytes_total", Help: "Bytes received from sources and written to the cache.",
		}),
		ingestSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "weightd_cache_ingest_seconds", Help: "Time to download, verify and commit one blob.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2.5, 14),
		}),
		verificationFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_verification_failures_total", Help: "Downloads discarded because their size or sha256 did not match.",
		}),
		diskFull: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_disk_full_total", Help: "Downloads refused or failed because the disk or the budget was full.",
		}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_cache_source_retries_total", Help: "Source requests retried after an error or a stall.",
		}),
	}
	if r == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{
		m.storedBytes, m.storedBlobs, m.partialBytes, m.budgetBytes, m.minFreeBytes, m.hits, m.misses, m.evictions,
		m.evictedBytes, m.ingestBytes, m.ingestSeconds, m.verificationFailures, m.diskFull, m.retries,
	} {
		if err := r.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
