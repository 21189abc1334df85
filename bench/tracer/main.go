// Command tracer measures the overhead of the eBPF model-load tracer
// (pkg/loadtrace) on a process that opens, reads to the end and closes
// 10,000 small files under a traced models directory, against the same
// process with the tracer detached. -files and -file-bytes set the shape
// (a model load is a few large files); -untraced points the tracer at
// another directory, so the workload is what every other process on a node
// pays. Runs alternate (without, with, floor), the first round warms the
// page cache and is discarded, and the best of each counts. The workload
// is a child process (this binary with -work), as the tracer ignores its
// own process; it times itself, so process start-up is not counted. The
// tracer runs in this process, as in the agent, with its aggregation live.
//
// The floor is the same workload with programs that return at once
// attached to the tracer's raw_syscalls tracepoints: what the hooks alone
// cost, which no program on them can go below (floor_ratio). The tracer's
// own work is ratio over floor_ratio.
//
// It needs root (loading BPF); elsewhere it says so and exits 0 without a
// figure. The last line is one JSON object:
//
//	{"bench":"tracer-overhead","files":10000,"file_bytes":4096,"traced":true,"ratio":with_s/without_s,"floor_ratio":floor_s/without_s,...}
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/loadtrace"
)

type result struct {
	Bench    string  `json:"bench"`
	Files    int     `json:"files"`
	Bytes    int     `json:"file_bytes"`
	Traced   bool    `json:"traced"`
	Ratio    float64 `json:"ratio"`
	WithS    float64 `json:"with_s"`
	WithoutS float64 `json:"without_s"`
	Floor    float64 `json:"floor_ratio"`
	FloorS   float64 `json:"floor_s"`
	Runs     int     `json:"runs"`
	Dropped  float64 `json:"dropped_events"`
}

func main() {
	files := flag.Int("files", 10000, "files opened, read and closed per run")
	fileBytes := flag.Int("file-bytes", 4096, "bytes in each file")
	untraced := flag.Bool("untraced", false, "trace another directory than the workload's")
	runs := flag.Int("runs", 7, "runs with and without the tracer (alternating); the best of each counts")
	work := flag.String("work", "", "internal: run the workload on this snapshot directory and print its seconds")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/tracer: ")
	if *work != "" {
		s, err := workload(*work, *files)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(s)
		return
	}
	if os.Geteuid() != 0 {
		log.Print("skipped: loading the tracer needs root")
		return
	}

	root, err := os.MkdirTemp("", "weightd-bench-tracer-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)
	models := filepath.Join(root, "models")
	snap := filepath.Join(models, "models--bench--model", "snapshots", "main")
	if err := os.MkdirAll(snap, 0o755); err != nil {
		log.Fatal(err)
	}
	content := []byte(strings.Repeat("w", *fileBytes))
	for i := range *files {
		if err := os.WriteFile(filepath.Join(snap, name(i)), content, 0o644); err != nil {
			log.Fatal(err)
		}
	}

	var with, without, floor []float64
	var dropped float64
	for i := range *runs + 1 {
		w, err := child(snap, *files)
		if err != nil {
			log.Fatal(err)
		}
		dir := models
		if *untraced {
			dir = filepath.Join(root, "elsewhere")
		}
		t, d, err := traced(dir, func() (float64, error) { return child(snap, *files) })
		if err != nil {
			log.Fatal(err)
		}
		f, err := hooksOnly(func() (float64, error) { return child(snap, *files) })
		if err != nil {
			log.Fatal(err)
		}
		if i == 0 {
			continue // warm-up
		}
		without, with, floor = append(without, w), append(with, t), append(floor, f)
		dropped += d
	}
	res := result{Bench: "tracer-overhead", Files: *files, Bytes: *fileBytes, Traced: !*untraced,
		WithS: best(with), WithoutS: best(without), FloorS: best(floor), Runs: *runs, Dropped: dropped}
	res.Ratio = res.WithS / res.WithoutS
	res.Floor = res.FloorS / res.WithoutS
	b, err := json.Marshal(res)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(b))
}

func name(i int) string { return fmt.Sprintf("f%05d.bin", i) }

// workload opens, reads to the end and closes each file, by absolute path,
// as a model loader does.
func workload(dir string, n int) (float64, error) {
	buf := make([]byte, 1<<20)
	start := time.Now()
	for i := range n {
		f, err := os.Open(filepath.Join(dir, name(i)))
		if err != nil {
			return 0, err
		}
		err = readAll(f, buf)
		f.Close()
		if err != nil {
			return 0, err
		}
	}
	return time.Since(start).Seconds(), nil
}

// readAll reads f to its end with read(2) into buf.
func readAll(f *os.File, buf []byte) error {
	for {
		_, err := f.Read(buf)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// child runs the workload in a child process and returns its seconds.
func child(dir string, n int) (float64, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	out, err := exec.Command(exe, "-work", dir, "-files", strconv.Itoa(n)).Output()
	if err != nil {
		return 0, fmt.Errorf("running the workload: %w", err)
	}
	return strconv.ParseFloat(strings.TrimSpace(string(out)), 64)
}

// traced runs f with a tracer attached to models and returns f's seconds
// and the events the tracer dropped.
func traced(models string, f func() (float64, error)) (float64, float64, error) {
	reg := prometheus.NewRegistry()
	tr, err := loadtrace.New(loadtrace.Config{ModelsDirs: []string{models}, Registerer: reg, Quiet: 50 * time.Millisecond})
	if err != nil {
		return 0, 0, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tr.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			log.Print(err)
		}
	}()
	for !attached(reg) {
		select {
		case err := <-done:
			done <- err
			return 0, 0, fmt.Errorf("the tracer did not attach (%v)", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	s, err := f()
	if err != nil {
		return 0, 0, err
	}
	return s, dropped(reg), nil
}

// hooksOnly runs f with programs that return at once attached where the
// tracer hooks every syscall (raw_syscalls sys_enter and sys_exit), and
// returns f's seconds.
func hooksOnly(f func() (float64, error)) (float64, error) {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.RawTracepoint,
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
		License:      "GPL",
	})
	if err != nil {
		return 0, fmt.Errorf("loading an empty program: %w", err)
	}
	defer prog.Close()
	for _, tp := range []string{"sys_enter", "sys_exit"} {
		l, err := link.AttachRawTracepoint(link.RawTracepointOptions{Name: tp, Program: prog})
		if err != nil {
			return 0, fmt.Errorf("attaching an empty program to %s: %w", tp, err)
		}
		defer l.Close()
	}
	return f()
}

func attached(reg *prometheus.Registry) bool { return gauge(reg, "weightd_loadtrace_available") == 1 }

func dropped(reg *prometheus.Registry) float64 {
	return gauge(reg, "weightd_loadtrace_dropped_events_total")
}

// gauge sums the values of the metric name, whatever its labels.
func gauge(reg *prometheus.Registry, name string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			sum += m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	return sum
}

func best(xs []float64) float64 {
	b := xs[0]
	for _, x := range xs[1:] {
		b = min(b, x)
	}
	return b
}
