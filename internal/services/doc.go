// Package services starts and stops real components — Debian's
// docker-registry (distribution 2.8) and containerd 1.6 — on loopback, each
// in a private directory, for tests and for the whole-system benchmarks under
// bench/. A containerd 2.x, built from the Go module proxy and cached by
// version (BuildContainerd), runs the same way, or inside a testbed host's
// network namespace (ContainerdConfig.Host). Helm, for the chart's tests,
// and promtool, for the alert rules' unit tests, are built and cached the
// same way (BuildHelm, RequireHelm; BuildPromtool, RequirePromtool).
//
// The core API takes a context and a directory and returns errors, so bench
// main programs can use it; NewRegistryT and NewContainerdT are its wrappers
// for tests: they skip when the binary is missing or the process is not root
// (or fail under CI=true, where a missing component is a broken CI machine)
// and stop the component when the test ends.
//
// A Registry sits behind an in-process TCP proxy that counts the bytes it
// serves and keeps the same address across Stop and Start, so a test can take
// the upstream down and bring it back. With RegistryConfig.TokenAuth it
// requires Docker registry tokens from an in-process token server that grants
// pull and push to one random user.
package services
