// Package catalog is the catalogue of weightd's Prometheus metrics, read
// from the repository's Go source rather than from one binary's wiring, so
// that a metric is catalogued as soon as a package defines it.
//
// Scan parses every non-test Go file under a module root (go/parser) and
// finds the collectors that client_golang's constructors build
// (prometheus.NewCounter, NewGaugeVec, NewHistogramFunc, …, and NewDesc with
// the const metrics made from it): the metric's name composed from the
// Opts' Namespace, Subsystem and Name, its type from the constructor, its
// labels from the label slice literal and ConstLabels, its help. Names and
// labels must be string constants; anything else is an error, so that the
// catalogue can never silently miss a metric.
//
// Lint checks the catalogue against Prometheus naming conventions and
// weightd's rules (the weightd_ prefix, unit suffixes, _total counters,
// promlint's checks, and labels from a bounded allowlist: see Labels), and
// Markdown renders it as the table in docs/metrics.md.
package catalog
