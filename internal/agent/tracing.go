package agent

import (
	"context"
	"fmt"
	"net/url"
	"os"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// TracingConfig is where the agent sends OpenTelemetry traces: nowhere by
// default. The standard OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) environment variable also turns
// tracing on, with the exporter's other OTEL_EXPORTER_OTLP_* settings
// (headers, timeout, TLS); --otel-endpoint wins over it.
type TracingConfig struct {
	OtelEndpoint    string  `name:"otel-endpoint" help:"OTLP/HTTP collector to send traces to, such as http://collector:4318 (/v1/traces is added to a URL without a path); empty with no OTEL_EXPORTER_OTLP_ENDPOINT disables tracing." env:"WEIGHTD_OTEL_ENDPOINT"`
	OtelSampleRatio float64 `name:"otel-sample-ratio" help:"Fraction of prefetch jobs traced, 0 to 1 (a job in a traced request is traced whatever it is)." default:"1" env:"WEIGHTD_OTEL_SAMPLE_RATIO"`
}

// enabled says whether traces go anywhere.
func (c TracingConfig) enabled() bool {
	return c.OtelEndpoint != "" || os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// NewTracerProvider returns the tracer provider the agent's components trace
// with: a no-op one when tracing is disabled, else one that batches spans to
// the OTLP/HTTP endpoint, sampled by trace ID at the configured ratio, with
// service.name weightd, its version and the node's name (k8s.node.name) as
// resource attributes (OTEL_RESOURCE_ATTRIBUTES adds more). shutdown flushes
// what is batched and stops the exporter; it is never nil. An enabled
// provider runs the batcher's goroutine from the start: build it where the
// agent starts running (the agent command's Run), not in New.
func NewTracerProvider(ctx context.Context, cfg TracingConfig, node, version string) (trace.TracerProvider, func(context.Context) error, error) {
	nothing := func(context.Context) error { return nil }
	if cfg.OtelSampleRatio < 0 || cfg.OtelSampleRatio > 1 {
		return nil, nothing, fmt.Errorf("--otel-sample-ratio must be between 0 and 1, not %v", cfg.OtelSampleRatio)
	}
	if !cfg.enabled() {
		return noop.NewTracerProvider(), nothing, nil
	}
	var opts []otlptracehttp.Option
	if cfg.OtelEndpoint != "" {
		u, err := url.Parse(cfg.OtelEndpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, nothing, fmt.Errorf("--otel-endpoint %q: want http(s)://host:port[/path]", cfg.OtelEndpoint)
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/v1/traces"
		}
		opts = append(opts, otlptracehttp.WithEndpointURL(u.String()))
	}
	exp, err := otlptracehttp.New(ctx, opts...)
	if err != nil {
		return nil, nothing, fmt.Errorf("creating the OTLP trace exporter: %w", err)
	}
	attrs := []attribute.KeyValue{
		attribute.String("service.name", "weightd"),
		attribute.String("service.version", version),
	}
	if node != "" {
		attrs = append(attrs, attribute.String("k8s.node.name", node))
	}
	res, err := resource.New(ctx, resource.WithTelemetrySDK(), resource.WithAttributes(attrs...), resource.WithFromEnv())
	if err != nil {
		return nil, nothing, fmt.Errorf("describing the tracing resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.OtelSampleRatio))),
	)
	return tp, tp.Shutdown, nil
}
