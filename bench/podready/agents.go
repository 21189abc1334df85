package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/weightd/weightd/internal/benchnet"
)

// scrapeMetrics returns the agent's /metrics, read from inside its host (its
// metrics server listens on the host's address, which only the testbed's
// namespaces reach): the bench re-executes itself there with -scrape.
func scrapeMetrics(ctx context.Context, a *benchnet.Agent) (string, error) {
	exe, err := os.Executable()
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	url := "http://" + netip.AddrPortFrom(a.Host.Addr, benchnet.MetricsPort).String() + "/metrics"
	cmd := a.Host.Command(ctx, exe, "-scrape", url)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("reading %s's metrics: %w: %s", a.Node, err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// sumMetric adds the samples of metric in the Prometheus text exposition
// whose labels contain label (e.g. `source="peer"`).
func sumMetric(text, metric, label string) int64 {
	var sum float64
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, metric+"{")
		if !ok {
			continue
		}
		labels, value, ok := strings.Cut(rest, "} ")
		if !ok || !strings.Contains(labels, label) {
			continue
		}
		f := strings.Fields(value)
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			sum += v
		}
	}
	return int64(sum)
}
