package catalog

import (
	"fmt"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

// Prefix starts every weightd metric's name.
const Prefix = "weightd_"

// nonBaseUnits are name parts that are units Prometheus wants in base units
// (seconds, bytes, ratios of 0–1) instead.
var nonBaseUnits = []string{
	"milliseconds", "microseconds", "nanoseconds", "millis", "ms", "us", "ns", "minutes", "hours", "days",
	"kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "gigabytes", "bits", "percent", "pct",
}

// Lint checks every metric against Prometheus naming conventions and
// weightd's rules and returns the problems, one line each:
//   - the weightd_ prefix, lower snake case, a help text;
//   - counters end in _total, and nothing else does;
//   - histograms and summaries measure seconds or bytes (end in _seconds or
//     _bytes); _info metrics are gauges without a unit; _ratio metrics are
//     gauges; base units only (no _milliseconds, _mb, _percent, …);
//   - promlint's checks, on a registry holding one series of each metric;
//   - labels from Labels, or from MetricLabels for that metric; never a name
//     from Unbounded otherwise.
func (c *Catalogue) Lint() []string {
	var problems []string
	bad := func(m Metric, format string, args ...any) {
		problems = append(problems, m.Name+": "+fmt.Sprintf(format, args...))
	}
	for _, m := range c.Metrics {
		base := strings.TrimSuffix(m.Name, "_total")
		parts := strings.Split(m.Name, "_")
		switch {
		case !strings.HasPrefix(m.Name, Prefix):
			bad(m, "does not start with %s", Prefix)
		case m.Name != strings.ToLower(m.Name) || strings.Contains(m.Name, "__") || strings.HasSuffix(m.Name, "_"):
			bad(m, "is not lower snake case")
		}
		if strings.TrimSpace(m.Help) == "" {
			bad(m, "has no help text")
		}
		if m.Type == Counter && !strings.HasSuffix(m.Name, "_total") {
			bad(m, "is a counter but does not end in _total")
		}
		if m.Type != Counter && strings.HasSuffix(m.Name, "_total") {
			bad(m, "is a %s but ends in _total, which is for counters", m.Type)
		}
		if (m.Type == Histogram || m.Type == Summary) && !strings.HasSuffix(m.Name, "_seconds") && !strings.HasSuffix(m.Name, "_bytes") {
			bad(m, "is a %s but does not end in a unit (_seconds or _bytes)", m.Type)
		}
		if strings.HasSuffix(m.Name, "_info") && m.Type != Gauge {
			bad(m, "is an info metric but a %s, not a gauge", m.Type)
		}
		if strings.HasSuffix(base, "_ratio") && m.Type != Gauge {
			bad(m, "is a ratio but a %s, not a gauge", m.Type)
		}
		for _, p := range parts {
			if slices.Contains(nonBaseUnits, p) {
				bad(m, "uses the unit %q: use base units (seconds, bytes, a 0–1 _ratio)", p)
			}
		}
		for _, l := range m.Labels {
			if _, ok := MetricLabels[MetricLabel{m.Name, l}]; ok {
				continue
			}
			if slices.Contains(Unbounded, l) {
				bad(m, "has the label %q, unbounded in general: allow it on this metric in MetricLabels with why its values are bounded", l)
				continue
			}
			if _, ok := Labels[l]; !ok {
				bad(m, "has the label %q, not in the allowlist (Labels) of bounded labels", l)
			}
		}
	}
	for k := range MetricLabels {
		m, ok := c.Lookup(k.Metric)
		if ok && !slices.Contains(m.Labels, k.Label) {
			bad(m, "MetricLabels allows the label %q, which it does not have", k.Label)
		}
	}
	lint, err := c.promlint()
	if err != nil {
		return append(problems, "promlint: "+err.Error())
	}
	return append(problems, lint...)
}

// promlint runs client_golang's promlint on a registry holding one series of
// each metric in the catalogue.
func (c *Catalogue) promlint() ([]string, error) {
	reg := prometheus.NewPedanticRegistry()
	for _, m := range c.Metrics {
		col, err := m.sample()
		if err != nil {
			return nil, err
		}
		if err := reg.Register(col); err != nil {
			return nil, fmt.Errorf("registering %s: %w", m.Name, err)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		return nil, err
	}
	found, err := promlint.NewWithMetricFamilies(mfs).Lint()
	if err != nil {
		return nil, err
	}
	var problems []string
	for _, p := range found {
		problems = append(problems, p.Metric+": "+p.Text+" (promlint)")
	}
	return problems, nil
}

// sample returns a collector of m with one series: every label set to "x".
func (m Metric) sample() (prometheus.Collector, error) {
	values := make([]string, len(m.Labels))
	for i := range values {
		values[i] = "x"
	}
	switch m.Type {
	case Counter:
		v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: m.Name, Help: m.Help}, m.Labels)
		v.WithLabelValues(values...).Inc()
		return v, nil
	case Gauge:
		v := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: m.Name, Help: m.Help}, m.Labels)
		v.WithLabelValues(values...).Set(1)
		return v, nil
	case Histogram:
		v := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: m.Name, Help: m.Help}, m.Labels)
		v.WithLabelValues(values...).Observe(1)
		return v, nil
	case Summary:
		v := prometheus.NewSummaryVec(prometheus.SummaryOpts{Name: m.Name, Help: m.Help}, m.Labels)
		v.WithLabelValues(values...).Observe(1)
		return v, nil
	case Untyped:
		labels := prometheus.Labels{}
		for _, l := range m.Labels {
			labels[l] = "x"
		}
		return prometheus.NewUntypedFunc(prometheus.UntypedOpts{Name: m.Name, Help: m.Help, ConstLabels: labels}, func() float64 { return 1 }), nil
	}
	return nil, fmt.Errorf("metric %s has the unknown type %q", m.Name, m.Type)
}
