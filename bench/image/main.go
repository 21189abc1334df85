// Command image measures the image path against containerd's own pull, in
// one run on one machine, with a real docker-registry and a real containerd
// (both started here; root needed):
//
//  1. image-prefetch: an image of N gzip layers (8 × 256 MiB by default) is
//     pushed to the registry; then, alternately, `ctr images pull` (fetch and
//     unpack into the k8s.io namespace) and `weightd fetch oci://…` against a
//     fresh `weightd agent` that imports into the same containerd, each from
//     an empty containerd and an empty cache. It prints
//     {"bench":"image-prefetch","size_bytes":…,"weightd_s":…,"ctr_s":…,"ratio":ctr_s/weightd_s,…}
//     with each side's best round, and every round's seconds. Where the
//     agent's cache and containerd's content store share a filesystem (here
//     both are under -dir) the agent hard-links the cached blobs into
//     containerd rather than writing them over gRPC; linked_blobs counts
//     the blobs of containerd's content store that are such links after
//     the last round. -copy (the agent's --containerd-content-root none)
//     writes them all over gRPC, as an agent without links does.
//  2. mirror-pull: the image is removed from containerd, the registry is
//     stopped, and `ctr images pull --hosts-dir` (what the kubelet's pull
//     does through hosts.toml) pulls it through the agent's registry mirror
//     from the weightd cache alone. It prints
//     {"bench":"mirror-pull","size_bytes":…,"seconds":…,"upstream_bytes":…,"ok":true}
//     where upstream_bytes counts what the registry sent during that pull.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
)

type prefetchResult struct {
	Bench     string  `json:"bench"`
	SizeBytes int64   `json:"size_bytes"`
	Layers    int     `json:"layers"`
	WeightdS  float64 `json:"weightd_s"`
	CtrS      float64 `json:"ctr_s"`
	Ratio     float64 `json:"ratio"`
	// Every round's seconds, in order: the machine may be shared.
	WeightdRounds []float64 `json:"weightd_rounds_s"`
	CtrRounds     []float64 `json:"ctr_rounds_s"`
	// LinkedBlobs counts the blobs in containerd's content store that are
	// the cache's files (hard links) after the last weightd round.
	LinkedBlobs int `json:"linked_blobs"`
}

type mirrorResult struct {
	Bench         string  `json:"bench"`
	SizeBytes     int64   `json:"size_bytes"`
	Seconds       float64 `json:"seconds"`
	UpstreamBytes int64   `json:"upstream_bytes"`
	OK            bool    `json:"ok"`
}

func main() {
	layers := flag.Int("layers", 8, "image layers")
	layerMiB := flag.Int64("layer-mib", 256, "random bytes per layer, MiB")
	rounds := flag.Int("rounds", 2, "rounds of each side; the best counts")
	bin := flag.String("weightd", "", "weightd binary (default: build ./cmd/weightd)")
	agentLog := flag.String("agent-log-level", "warn", "the agent's --log-level (its log goes to stderr)")
	profile := flag.String("agent-profile", "", "write a CPU profile of the agent's fetch in each round to this directory (as agent-<round>.pprof)")
	dir := flag.String("dir", "", "working directory (default: a new temporary directory, removed at the end)")
	copyBlobs := flag.Bool("copy", false, "have the agent write blobs into containerd over gRPC, never hard-link them (--containerd-content-root none)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("bench/image: ")
	if *layers < 1 || *layerMiB < 1 || *rounds < 1 {
		log.Fatal("-layers, -layer-mib and -rounds must be positive")
	}
	if err := services.RegistryAvailable(); err != nil {
		log.Fatal(err)
	}
	if err := services.ContainerdAvailable(); err != nil {
		log.Fatal(err)
	}
	work := *dir
	if work == "" {
		var err error
		if work, err = os.MkdirTemp("", "wdimg"); err != nil { // short: unix socket paths
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
	var agentArgs []string
	if *copyBlobs {
		agentArgs = append(agentArgs, "--containerd-content-root", "none")
	}
	if err := run(ctx, work, *bin, *agentLog, *profile, agentArgs, *layers, *layerMiB<<20, *rounds); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, work, bin, agentLog, profile string, agentArgs []string, layers int, layerSize int64, rounds int) error {
	reg, err := services.StartRegistry(ctx, services.RegistryConfig{Dir: filepath.Join(work, "registry")})
	if err != nil {
		return err
	}
	defer reg.Close()
	ctrd, err := services.StartContainerd(ctx, services.ContainerdConfig{Dir: filepath.Join(work, "ctrd")})
	if err != nil {
		return err
	}
	defer ctrd.Close()
	log.Printf("pushing a %d × %d MiB image", layers, layerSize>>20)
	img, err := services.PushRandomImage(ctx, reg.Addr, "bench/image", "v1", layers, layerSize, nil)
	if err != nil {
		return err
	}
	mirrorAddr, err := freeAddr()
	if err != nil {
		return err
	}

	meter := newCPUMeter(ctrd.Dir, reg.Dir)
	var best struct{ ctr, weightd time.Duration }
	var ctrRounds, weightdRounds []float64
	var last *agent
	for r := range rounds {
		cpu := meter.sample()
		took, err := ctrPull(ctx, ctrd, img.Ref)
		if err != nil {
			return err
		}
		log.Printf("round %d: ctr images pull %.2f s (%s)", r+1, took.Seconds(), meter.since(cpu, nil))
		best.ctr = minPositive(best.ctr, took)
		ctrRounds = append(ctrRounds, benchfig.Round(took.Seconds(), 3))
		if err := removeImage(ctx, ctrd, img.Ref); err != nil {
			return err
		}

		if last != nil {
			last.stop()
		}
		a, err := startAgent(ctx, bin, agentLog, profile != "", agentArgs, filepath.Join(work, fmt.Sprintf("w%d", r)), ctrd, reg.Addr, mirrorAddr)
		if err != nil {
			return err
		}
		last = a
		syscall.Sync()
		cpu = meter.sample()
		agentCPU := cpuOf(a.cmd.Process.Pid)
		var stopProfile func() error
		if profile != "" {
			stopProfile = a.startProfile(ctx, filepath.Join(profile, fmt.Sprintf("agent-%d.pprof", r+1)))
		}
		took, err = a.fetch(ctx, "oci://"+img.Ref)
		if err != nil {
			return err
		}
		if stopProfile != nil {
			if err := stopProfile(); err != nil {
				log.Printf("profiling the agent: %v", err)
			}
		}
		agentCPU = cpuOf(a.cmd.Process.Pid) - agentCPU
		log.Printf("round %d: weightd fetch (into the cache and containerd) %.2f s (%s)", r+1, took.Seconds(), meter.since(cpu, &agentCPU))
		best.weightd = minPositive(best.weightd, took)
		weightdRounds = append(weightdRounds, benchfig.Round(took.Seconds(), 3))
		if r < rounds-1 {
			if err := removeImage(ctx, ctrd, img.Ref); err != nil {
				return err
			}
		}
	}
	defer last.stop()
	if err := emit(prefetchResult{
		Bench: "image-prefetch", SizeBytes: img.Size, Layers: layers, WeightdS: benchfig.Round(best.weightd.Seconds(), 3),
		CtrS: benchfig.Round(best.ctr.Seconds(), 3), Ratio: benchfig.Round(best.ctr.Seconds()/best.weightd.Seconds(), 3),
		WeightdRounds: weightdRounds, CtrRounds: ctrRounds,
		LinkedBlobs: linkedBlobs(filepath.Join(ctrd.Root, "io.containerd.content.v1.content", "blobs", "sha256")),
	}); err != nil {
		return err
	}

	// The kubelet's pull of an image weightd holds, with the registry down.
	if err := removeImage(ctx, ctrd, img.Ref); err != nil {
		return err
	}
	reg.Stop()
	before := reg.BytesServed()
	syscall.Sync()
	start := time.Now()
	out, err := ctrd.Ctr(ctx, "images", "pull", "--hosts-dir", ctrd.HostsDir, img.Ref)
	took := time.Since(start)
	res := mirrorResult{Bench: "mirror-pull", SizeBytes: img.Size, Seconds: benchfig.Round(took.Seconds(), 3), UpstreamBytes: reg.BytesServed() - before, OK: err == nil}
	if err != nil {
		log.Printf("pull through the mirror failed: %v\n%s", err, out)
	}
	return emit(res)
}

// agent is a weightd agent process importing into containerd and serving
// the registry mirror.
type agent struct {
	cmd       *exec.Cmd
	client    *api.Client
	pprofAddr string // with --pprof-addr, or ""
}

// startProfile starts a 20-second CPU profile of the agent; wait waits for
// it and writes it to path.
func (a *agent) startProfile(ctx context.Context, path string) (wait func() error) {
	done := make(chan error, 1)
	go func() {
		done <- func() error {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+a.pprofAddr+"/debug/pprof/profile?seconds=20", nil)
			if err != nil {
				return err
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			if err != nil {
				return err
			}
			return os.WriteFile(path, b, 0o644)
		}()
	}()
	return func() error { return <-done }
}

func startAgent(ctx context.Context, bin, logLevel string, pprof bool, extra []string, root string, ctrd *services.Containerd, registry, mirrorAddr string) (*agent, error) {
	sock := "unix://" + root + ".sock"
	pprofAddr := ""
	if pprof {
		var err error
		if pprofAddr, err = freeAddr(); err != nil {
			return nil, err
		}
	}
	args := []string{"agent", "--root", root, "--api", sock, "--metrics-addr", "", "--pprof-addr", pprofAddr, "--log-level", logLevel}
	cmd := exec.CommandContext(ctx, bin, append(args,
		"--gossip-addr", "", "--chunk-addr", "",
		"--containerd-address", ctrd.Address, "--insecure-registries", registry,
		"--mirror-addr", mirrorAddr, "--mirror-registries", registry, "--hosts-dir", ctrd.HostsDir)...)
	cmd.Args = append(cmd.Args, extra...)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	client, err := api.NewClient(sock)
	if err == nil {
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = client.WaitReady(rctx)
		cancel()
	}
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("starting the agent: %w", err)
	}
	return &agent{cmd: cmd, client: client, pprofAddr: pprofAddr}, nil
}

// fetch prefetches ref and waits until it is ready: in the cache and, for an
// image, imported and unpacked in containerd.
func (a *agent) fetch(ctx context.Context, ref string) (time.Duration, error) {
	start := time.Now()
	st, err := a.client.Submit(ctx, api.FetchRequest{Ref: ref, Priority: "pod"})
	if err != nil {
		return 0, err
	}
	if st, err = a.client.Watch(ctx, st.ID, nil); err != nil {
		return 0, err
	}
	if st.State != prefetch.StateReady {
		return 0, fmt.Errorf("weightd fetch %s: %s", ref, st.Error)
	}
	return time.Since(start), nil
}

func (a *agent) stop() {
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	_ = a.cmd.Wait()
}

// ctrPull is the baseline: containerd's own client fetches and unpacks.
func ctrPull(ctx context.Context, ctrd *services.Containerd, ref string) (time.Duration, error) {
	syscall.Sync()
	start := time.Now()
	if out, err := ctrd.Ctr(ctx, "images", "pull", "--plain-http", ref); err != nil {
		return 0, fmt.Errorf("ctr images pull: %v\n%s", err, out)
	}
	return time.Since(start), nil
}

// removeImage deletes the image, and every other, with their content and
// snapshots, so the next pull starts empty.
func removeImage(ctx context.Context, ctrd *services.Containerd, ref string) error {
	out, err := ctrd.Ctr(ctx, "images", "ls", "-q")
	if err != nil {
		return err
	}
	if !slices.Contains(strings.Fields(string(out)), ref) {
		return fmt.Errorf("containerd does not list %s:\n%s", ref, out)
	}
	return ctrd.RemoveImages(ctx)
}

// linkedBlobs counts the files in dir with more than one name: blobs of
// containerd's content store that are hard links to the agent's cache.
func linkedBlobs(dir string) int {
	entries, _ := os.ReadDir(dir)
	n := 0
	for _, e := range entries {
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(dir, e.Name()), &st) == nil && st.Nlink > 1 {
			n++
		}
	}
	return n
}

// freeAddr returns a loopback address nothing listens on now.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// cpuMeter reads the CPU time (user and system) that the processes doing
// the work have spent: containerd, the registry, and the client (ctr, a
// child that has exited, or the agent).
type cpuMeter struct{ containerd, registry int }

type cpuSample struct{ containerd, registry, children time.Duration }

func newCPUMeter(ctrdDir, registryDir string) cpuMeter {
	return cpuMeter{containerd: pidOf(services.ContainerdBinary, ctrdDir), registry: pidOf(services.RegistryBinary, registryDir)}
}

func (m cpuMeter) sample() cpuSample {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru)
	return cpuSample{containerd: cpuOf(m.containerd), registry: cpuOf(m.registry), children: time.Duration(ru.Utime.Nano() + ru.Stime.Nano())}
}

// since formats the CPU seconds spent since s; client is the client's (nil:
// the exited children's).
func (m cpuMeter) since(s cpuSample, client *time.Duration) string {
	now := m.sample()
	c := now.children - s.children
	if client != nil {
		c = *client
	}
	return fmt.Sprintf("CPU s: containerd %.1f, registry %.1f, client %.1f",
		(now.containerd - s.containerd).Seconds(), (now.registry - s.registry).Seconds(), c.Seconds())
}

// pidOf finds the process of bin whose command line mentions marker, or 0.
func pidOf(bin, marker string) int {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if strings.HasPrefix(string(cmdline), bin) && strings.Contains(string(cmdline), marker) {
			return pid
		}
	}
	return 0
}

// cpuOf is the CPU time process pid has spent, 0 if unknown.
func cpuOf(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 > len(s) {
		return 0
	}
	f := strings.Fields(s[i+2:])
	if len(f) < 13 {
		return 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}

func minPositive(a, b time.Duration) time.Duration {
	if a == 0 || b < a {
		return b
	}
	return a
}

func emit(v any) error { return json.NewEncoder(os.Stdout).Encode(v) }
