// Package monitoring tests deploy/monitoring, weightd's Grafana dashboards
// and Prometheus alerts: every dashboard and rule file parses, every PromQL
// expression in them parses (Grafana's variables substituted first), names
// only metrics that weightd's source defines (internal/metricscatalog) with
// a type that fits how it is used and labels that the metric has, and every
// alert says what is wrong and what to do in its annotations. promtool
// checks the rules and runs their unit tests (testdata/promtool): each
// alert fires on the series the chart's monitors scrape, with the labels
// and annotations expected, and stays quiet where it must.
//
// deploy/monitoring is rendered from charts/weightd (its dashboards/ and
// rules/; test/deploy fails while the two differ), so these checks hold for
// the chart too.
package monitoring
