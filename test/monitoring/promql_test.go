package monitoring

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/prometheus/prometheus/promql/parser"

	"github.com/weightd/weightd/internal/metricscatalog/catalog"
)

// targetLabels are the labels every scraped series of weightd carries: the
// Prometheus Operator's for a PodMonitor or ServiceMonitor target, and node,
// which the chart's monitors relabel from the pod's node name.
var targetLabels = []string{"instance", "job", "namespace", "pod", "container", "endpoint", "service", "node"}

// rangeFuncs are the functions whose argument must be a counter (or a
// histogram's or summary's _bucket, _sum or _count series).
var rangeFuncs = []string{"rate", "irate", "increase", "resets"}

var (
	grafanaRanges = regexp.MustCompile(`\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}`)
	grafanaVars   = regexp.MustCompile(`\$\{[A-Za-z0-9_:]+\}|\$[A-Za-z_][A-Za-z0-9_]*`)
)

// substitute replaces Grafana's variables in expr with values PromQL
// parses: durations for the interval variables, "x" for the others (they
// appear in label matchers' strings).
func substitute(expr string) string {
	expr = grafanaRanges.ReplaceAllString(expr, "5m")
	return grafanaVars.ReplaceAllString(expr, "x")
}

// checkExpr parses expr and checks every metric it selects against cat: the
// name exists (a histogram's _bucket, _sum, _count series resolve to it),
// counters are only read through rate, irate, increase or resets and
// gauges never are, histogram_quantile reads _bucket series, and every label
// matched or grouped by is one of the metric's labels or a target label.
func checkExpr(cat *catalog.Catalogue, expr string) error {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(substitute(expr))
	if err != nil {
		return fmt.Errorf("parsing %q: %w", expr, err)
	}
	var errs []error
	parser.Inspect(e, func(n parser.Node, path []parser.Node) error {
		switch n := n.(type) {
		case *parser.VectorSelector:
			errs = append(errs, checkSelector(cat, n, path))
		case *parser.AggregateExpr:
			errs = append(errs, checkGrouping(cat, n.Expr, n.Grouping))
		case *parser.BinaryExpr:
			if n.VectorMatching != nil {
				errs = append(errs, checkGrouping(cat, n.LHS, n.VectorMatching.MatchingLabels),
					checkGrouping(cat, n.RHS, n.VectorMatching.MatchingLabels))
			}
		case *parser.Call:
			if n.Func.Name == "histogram_quantile" && !slices.ContainsFunc(selectors(n.Args[1]), func(vs *parser.VectorSelector) bool {
				return strings.HasSuffix(name(vs), "_bucket")
			}) {
				errs = append(errs, fmt.Errorf("histogram_quantile over no _bucket series in %q", expr))
			}
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("in %q: %w", expr, err)
	}
	return nil
}

func name(vs *parser.VectorSelector) string {
	if vs.Name != "" {
		return vs.Name
	}
	for _, m := range vs.LabelMatchers {
		if m.Name == "__name__" {
			return m.Value
		}
	}
	return ""
}

func selectors(n parser.Node) []*parser.VectorSelector {
	var out []*parser.VectorSelector
	parser.Inspect(n, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			out = append(out, vs)
		}
		return nil
	})
	return out
}

func checkSelector(cat *catalog.Catalogue, vs *parser.VectorSelector, path []parser.Node) error {
	series := name(vs)
	m, ok := cat.Series(series)
	if !ok {
		return fmt.Errorf("metric %s: weightd defines no such metric (docs/metrics.md)", series)
	}
	inRange := slices.ContainsFunc(path, func(n parser.Node) bool {
		c, ok := n.(*parser.Call)
		return ok && slices.Contains(rangeFuncs, c.Func.Name)
	})
	sub := series != m.Name // a _bucket, _sum or _count series: a counter
	switch {
	case (m.Type == catalog.Counter || sub) && !inRange:
		return fmt.Errorf("metric %s is a counter (%s): read it through rate, irate or increase", series, m.Type)
	case m.Type == catalog.Gauge && inRange:
		return fmt.Errorf("metric %s is a gauge: rate, irate and increase are for counters", series)
	case (m.Type == catalog.Histogram || m.Type == catalog.Summary) && !sub:
		return fmt.Errorf("metric %s is a %s: select its _bucket, _sum or _count series", series, m.Type)
	}
	for _, l := range vs.LabelMatchers {
		if l.Name != "__name__" && !hasLabel(m, series, l.Name) {
			return fmt.Errorf("metric %s has no label %q (it has %v)", series, l.Name, m.Labels)
		}
	}
	return nil
}

// hasLabel reports whether series (of metric m) has the label l.
func hasLabel(m catalog.Metric, series, l string) bool {
	switch {
	case slices.Contains(m.Labels, l), slices.Contains(targetLabels, l):
		return true
	case l == "le":
		return strings.HasSuffix(series, "_bucket")
	case l == "quantile":
		return m.Type == catalog.Summary && series == m.Name
	}
	return false
}

// checkGrouping checks that each label in a by, without, on or ignoring
// clause is a label of some metric selected under e (unknown metrics are
// reported by checkSelector).
func checkGrouping(cat *catalog.Catalogue, e parser.Node, labels []string) error {
	vss := slices.DeleteFunc(selectors(e), func(vs *parser.VectorSelector) bool {
		_, ok := cat.Series(name(vs))
		return !ok
	})
	if len(vss) == 0 {
		return nil
	}
	for _, l := range labels {
		if !slices.ContainsFunc(vss, func(vs *parser.VectorSelector) bool {
			m, ok := cat.Series(name(vs))
			return ok && hasLabel(m, name(vs), l)
		}) {
			return fmt.Errorf("no metric under %s has the label %q", e, l)
		}
	}
	return nil
}
