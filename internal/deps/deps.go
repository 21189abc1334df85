// Package deps holds the modules that packages under construction will
// import, so that go.mod and go.sum name them before those packages land.
// It is removed once every module here is imported by real code.
package deps

import (
	_ "github.com/NVIDIA/go-nvml/pkg/nvml"
	_ "github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	_ "github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	_ "github.com/cilium/ebpf"
	_ "github.com/cilium/ebpf/link"
	_ "github.com/cilium/ebpf/ringbuf"
	_ "github.com/cilium/ebpf/rlimit"
	_ "github.com/prometheus/prometheus/promql/parser"
	_ "go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	_ "go.opentelemetry.io/otel/sdk/trace"
	_ "go.opentelemetry.io/otel/sdk/trace/tracetest"
)
