// Command ingest measures verified ingest from a local HTTP origin into the
// weightd cache against the naive baseline run in the same process tree:
// download to a file with curl, then sha256sum it.
//
// For each size it generates one random blob, serves it from an embedded
// origin on loopback, and times, as child processes, (1) curl + sha256sum and
// (2) `weightd fetch URL#sha256:… --wait` against a `weightd agent` whose
// peak RSS (VmHWM) it reads before stopping it. It prints one JSON line per
// size:
//
//	{"bench":"ingest","size_bytes":…,"weightd_s":…,"baseline_s":…,"ratio":…,"peak_rss_bytes":…}
//
// ratio = baseline_s / weightd_s: above 1 means weightd's single pass (hash
// while writing, verified, fsynced) beats download-then-hash.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/pkg/api"
)

type result struct {
	Bench        string  `json:"bench"`
	SizeBytes    int64   `json:"size_bytes"`
	WeightdS     float64 `json:"weightd_s"`
	BaselineS    float64 `json:"baseline_s"`
	Ratio        float64 `json:"ratio"`
	PeakRSSBytes int64   `json:"peak_rss_bytes"`
}

func main() {
	sizes := flag.String("sizes-mib", "1024,4096", "comma-separated blob sizes in MiB")
	bin := flag.String("weightd", "", "weightd binary (default: build ./cmd/weightd)")
	dir := flag.String("dir", "", "working directory (default: a new temporary directory, removed at the end)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/ingest: ")

	work := *dir
	if work == "" {
		var err error
		if work, err = os.MkdirTemp("", "weightd-bench-ingest-"); err != nil {
			log.Fatal(err)
		}
		defer os.RemoveAll(work)
	}
	if *bin == "" {
		*bin = filepath.Join(work, "weightd")
		if out, err := exec.Command("go", "build", "-o", *bin, "./cmd/weightd").CombinedOutput(); err != nil {
			log.Fatalf("building weightd: %v\n%s", err, out)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	originDir := filepath.Join(work, "origin")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	srv := genmodel.NewServer(ln, originDir)
	go func() {
		if err := srv.Run(ctx); err != nil {
			log.Print(err)
		}
	}()

	for _, s := range strings.Split(*sizes, ",") {
		mib, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || mib <= 0 {
			log.Fatalf("size %q: want a positive number of MiB", s)
		}
		size := mib << 20
		r, err := runSize(ctx, work, originDir, srv.URL(), *bin, size)
		if err != nil {
			log.Fatalf("size %s: %v", s, err)
		}
		if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
			log.Fatal(err)
		}
	}
}

func runSize(ctx context.Context, work, originDir, originURL, bin string, size int64) (result, error) {
	sub := fmt.Sprintf("s%d", size)
	m, err := genmodel.Generate(filepath.Join(originDir, sub), genmodel.Spec{Name: "bench/ingest", Files: 1, TotalBytes: size, Seed: uint64(size)})
	if err != nil {
		return result{}, err
	}
	defer os.RemoveAll(filepath.Join(originDir, sub))
	file := m.Files[0]
	url := originURL + "/" + sub + "/" + file.Path
	syncDisks()

	// The baseline: download to a file, then hash it.
	out := filepath.Join(work, "baseline.bin")
	start := time.Now()
	if b, err := exec.CommandContext(ctx, "curl", "-sSf", "-o", out, url).CombinedOutput(); err != nil {
		return result{}, fmt.Errorf("curl: %v: %s", err, b)
	}
	sum, err := exec.CommandContext(ctx, "sha256sum", out).Output()
	if err != nil {
		return result{}, fmt.Errorf("sha256sum: %v", err)
	}
	baseline := time.Since(start)
	if !strings.HasPrefix(string(sum), file.SHA256) {
		return result{}, fmt.Errorf("baseline hash %s, want %s", sum[:64], file.SHA256)
	}
	os.Remove(out)
	syncDisks()

	// weightd: an agent process, and the CLI asking it to fetch.
	root := filepath.Join(work, "cache")
	defer os.RemoveAll(root)
	sock := "unix://" + filepath.Join(work, "weightd.sock")
	agent := exec.CommandContext(ctx, bin, "agent", "--root", root, "--api", sock, "--metrics-addr", "", "--log-level", "warn",
		"--gossip-addr", "", "--chunk-addr", "", // one node: the ingest path alone
		"--fetch-allow-cidrs", "127.0.0.1/32") // the origin listens on loopback
	agent.Stderr = os.Stderr
	if err := agent.Start(); err != nil {
		return result{}, err
	}
	defer func() { _ = agent.Process.Kill() }() // a no-op once it has exited
	if err := waitReady(ctx, sock); err != nil {
		return result{}, err
	}
	start = time.Now()
	fetch := exec.CommandContext(ctx, bin, "fetch", "--wait", "--api", sock, url+"#sha256:"+file.SHA256)
	if b, err := fetch.CombinedOutput(); err != nil {
		return result{}, fmt.Errorf("weightd fetch: %v: %s", err, b)
	}
	took := time.Since(start)
	rss, err := peakRSS(agent.Process.Pid)
	if err != nil {
		return result{}, err
	}
	if err := agent.Process.Signal(syscall.SIGTERM); err != nil {
		return result{}, err
	}
	if err := agent.Wait(); err != nil {
		return result{}, fmt.Errorf("agent exit: %v", err)
	}
	return result{
		Bench: "ingest", SizeBytes: size, WeightdS: benchfig.Round(took.Seconds(), 3), BaselineS: benchfig.Round(baseline.Seconds(), 3),
		Ratio: benchfig.Round(baseline.Seconds()/took.Seconds(), 3), PeakRSSBytes: rss,
	}, nil
}

// waitReady waits, at most 30 s, until the agent's API answers.
func waitReady(ctx context.Context, addr string) error {
	client, err := api.NewClient(addr)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return client.WaitReady(ctx)
}

// peakRSS reads the high-water mark of a process's resident memory.
func peakRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}

// syncDisks flushes dirty pages so one phase's write-back does not slow the next.
func syncDisks() { syscall.Sync() }
