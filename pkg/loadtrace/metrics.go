package loadtrace

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Reasons an event is dropped, the label of
// weightd_loadtrace_dropped_events_total; the first three are counted in the
// kernel, in this order.
var dropReasons = []string{"ringbuf", "fds", "path", "bounds"}

type metrics struct {
	available prometheus.Gauge
	events    *prometheus.CounterVec
	seconds   prometheus.Histogram
	drops     *dropCollector
}

func (m *metrics) register(reg prometheus.Registerer, t *Tracer) error {
	m.available = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "weightd_loadtrace_available",
		Help: "1 while the eBPF model-load tracer is attached, 0 where it cannot load.",
	})
	m.events = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "weightd_loadtrace_events_total",
		Help: "Events the model-load tracer received, by kind (open, read, close, exit).",
	}, []string{"kind"})
	for _, k := range kindNames {
		if k != "" {
			m.events.WithLabelValues(k)
		}
	}
	m.seconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "weightd_model_load_seconds",
		Help:    "Time pods spent loading a model: first open of its files to last close.",
		Buckets: prometheus.ExponentialBuckets(0.05, 2, 15), // 50ms to ~14min
	})
	m.drops = &dropCollector{
		desc: prometheus.NewDesc("weightd_loadtrace_dropped_events_total",
			"Events the model-load tracer lost, by reason: ringbuf (ring buffer full), fds (the kernel map of open files full), path (the path of an open unreadable at its exit), bounds (the tracer's own limits).",
			[]string{"reason"}, nil),
	}
	active := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "weightd_loadtrace_loads_in_progress",
		Help: "Model loads the tracer sees in progress (pod and model pairs).",
	}, func() float64 {
		t.mu.Lock()
		defer t.mu.Unlock()
		return float64(len(t.active))
	})
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{m.available, m.events, m.seconds, m.drops, active} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("registering loadtrace metrics: %w", err)
		}
	}
	return nil
}

// dropCollector exports the kernel's per-CPU drop counters, summed, read at
// scrape time, plus the userspace ones. The kernel's counts survive Run's
// end as the last values read.
type dropCollector struct {
	desc   *prometheus.Desc
	bounds atomic.Uint64 // events dropped at the tracer's own bounds

	mu     sync.Mutex
	source func() ([3]uint64, error)
	last   [3]uint64
}

func (d *dropCollector) setSource(f func() ([3]uint64, error)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if f == nil && d.source != nil {
		d.refresh()
	}
	d.source = f
}

// refresh reads the kernel's counts; d.mu is held.
func (d *dropCollector) refresh() {
	if d.source == nil {
		return
	}
	if v, err := d.source(); err == nil {
		d.last = v
	}
}

// total returns the events lost so far, all reasons together.
func (d *dropCollector) total() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.refresh()
	return d.last[0] + d.last[1] + d.last[2] + d.bounds.Load()
}

func (d *dropCollector) Describe(ch chan<- *prometheus.Desc) { ch <- d.desc }

func (d *dropCollector) Collect(ch chan<- prometheus.Metric) {
	d.mu.Lock()
	d.refresh()
	v := d.last
	d.mu.Unlock()
	for i, n := range v {
		ch <- prometheus.MustNewConstMetric(d.desc, prometheus.CounterValue, float64(n), dropReasons[i])
	}
	ch <- prometheus.MustNewConstMetric(d.desc, prometheus.CounterValue, float64(d.bounds.Load()), dropReasons[3])
}
