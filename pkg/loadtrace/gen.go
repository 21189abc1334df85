//go:build linux

package loadtrace

//go:generate go tool bpf2go -cc clang-14 -target bpfel -tags linux loadtrace bpf/loadtrace.bpf.c -- -I/usr/include/x86_64-linux-gnu
