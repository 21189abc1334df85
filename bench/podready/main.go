// Command podready measures the time from a pod's creation to the agent's
// `weightd.io/status: ready` on it, for a model that a peer already holds,
// against the physical limit S/B of the node's link.
//
// It builds a testbed (internal/testbed: network namespaces on a bridge, so
// it needs root and iproute2) of three hosts, the origin host, node-a and
// node-b, each link shaped to B in both directions; starts a real etcd and
// kube-apiserver (internal/kubetest; built on the first run, about ten
// minutes) served inside the origin host's namespace too, so that agents
// there reach it (Env.NetnsKubeconfig); registers Nodes node-a and node-b
// and installs the PrefetchPolicy CRD; serves a generated model of S bytes
// from the origin host (internal/genmodel: the bench re-executes itself there); and
// starts a `weightd agent` on node-a and node-b, joined into one swarm, each
// with --kubeconfig and its Node's --node-name.
//
// node-a first fetches the model through its API, so that it holds it. Then
// the bench creates a pod bound to node-b (spec.nodeName; no kubelet runs,
// so it stays Pending) with the annotation `weightd.io/models: <ref>`, and
// watches it until the annotation `weightd.io/status` says ready. It logs
// where the time went on stderr (pod created → job created on node-b: the
// intake; → job finished: resolve and transfer; → status seen ready: the
// intake's status debounce and the write), and prints one JSON line on
// stdout:
//
//	{"bench":"pod-ready","size_bytes":S,"seconds":…,"limit_s":S*8/B,"time_ratio":seconds/limit_s,
//	 "link_mbit":B,"from_peers_bytes":…,"origin_bytes":…}
//
// from_peers_bytes and origin_bytes are node-b's
// weightd_p2p_received_bytes_total by source: the verified chunk bytes it
// took from peers and from the origin. Everything (processes, namespaces,
// the API server, the temporary directory) is removed at the end, on
// failure and on SIGINT or SIGTERM.
//
//	go run ./bench/podready -quick   # 128 MiB at 500 Mbit/s
//	go run ./bench/podready          # 512 MiB at 500 Mbit/s
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/benchnet"
	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/pkg/kube"
	"github.com/weightd/weightd/pkg/podrequest"
	"github.com/weightd/weightd/pkg/policy"
	"github.com/weightd/weightd/pkg/prefetch"
)

// originPort is the origin's port on the origin host.
const originPort = 8080

// The Nodes and the pod.
const (
	nodeA   = "node-a"
	nodeB   = "node-b"
	podName = "podready"
)

// options are the bench's flags.
type options struct {
	sizeMiB   int64
	files     int
	linkMbit  int
	chunkMiB  int
	weightd   string
	agentArgs string
	timeout   time.Duration
}

// result is the output line.
type result struct {
	Bench          string  `json:"bench"`
	SizeBytes      int64   `json:"size_bytes"`
	Seconds        float64 `json:"seconds"`
	LimitS         float64 `json:"limit_s"`
	TimeRatio      float64 `json:"time_ratio"`
	LinkMbit       int     `json:"link_mbit"`
	FromPeersBytes int64   `json:"from_peers_bytes"`
	OriginBytes    int64   `json:"origin_bytes"`
}

func main() {
	var (
		o                         options
		quick                     bool
		serveDir, listen, control string
		scrape                    string
	)
	flag.Int64Var(&o.sizeMiB, "size-mib", 512, "model size in MiB")
	flag.IntVar(&o.files, "files", 4, "files in the model")
	flag.IntVar(&o.linkMbit, "link-mbit", 500, "every host's link, each direction, in Mbit/s")
	flag.IntVar(&o.chunkMiB, "chunk-mib", 4, "the agents' chunk size in MiB")
	flag.StringVar(&o.weightd, "weightd", "", "weightd binary (default: go build ./cmd/weightd into the temporary directory)")
	flag.StringVar(&o.agentArgs, "agent-args", "", "more flags for both agents, space-separated (tuning experiments)")
	flag.DurationVar(&o.timeout, "timeout", 0, "the most each fetch may take (0: 10 × S/B + 2 min)")
	flag.BoolVar(&quick, "quick", false, "a fast check: 128 MiB unless -size-mib is set")
	flag.StringVar(&serveDir, "serve-origin", "", "internal: serve this directory as the origin (in the origin host)")
	flag.StringVar(&listen, "listen", "", "internal: the origin's address")
	flag.StringVar(&control, "control", "", "internal: the origin's control socket")
	flag.StringVar(&scrape, "scrape", "", "internal: print the body of this URL (in an agent's host)")
	flag.Parse()
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("bench/podready: ")

	var err error
	switch {
	case serveDir != "":
		err = benchnet.ServeOrigin(serveDir, listen, control)
	case scrape != "":
		err = printURL(scrape)
	default:
		if quick {
			err = benchnet.QuickDefaults(map[string]string{"size-mib": "128"})
		}
		if err == nil {
			err = benchnet.RunInterruptible(func(ctx context.Context) error { return run(ctx, o) })
		}
	}
	if err != nil {
		log.Print(err)
		os.Exit(1)
	}
}

func (o options) validate() error {
	switch {
	case o.sizeMiB < 1:
		return fmt.Errorf("-size-mib %d: want at least 1", o.sizeMiB)
	case o.files < 1:
		return fmt.Errorf("-files %d: want at least 1", o.files)
	case o.linkMbit < 1:
		return fmt.Errorf("-link-mbit %d: want at least 1", o.linkMbit)
	case o.chunkMiB < 1:
		return fmt.Errorf("-chunk-mib %d: want at least 1", o.chunkMiB)
	case o.timeout < 0:
		return fmt.Errorf("-timeout %v: want 0 or more", o.timeout)
	}
	return nil
}

// run sets everything up, measures, prints the line and tears everything
// down (the defers run on every path).
func run(ctx context.Context, o options) error {
	if err := o.validate(); err != nil {
		return err
	}
	if err := testbed.Available(); err != nil {
		return fmt.Errorf("the pod-ready bench runs on the namespace testbed: %w", err)
	}
	if _, err := kubetest.FindAssets(); err != nil {
		dir, derr := kubetest.AssetsDir()
		if derr != nil {
			return derr
		}
		log.Printf("building kube-apiserver and etcd into %s (about ten minutes the first time)", dir)
		if err := kubetest.BuildAssets(ctx, dir, os.Stderr); err != nil {
			return err
		}
	}
	size := o.sizeMiB << 20
	limit := time.Duration(float64(size) * 8 / (float64(o.linkMbit) * 1e6) * float64(time.Second))
	if o.timeout == 0 {
		o.timeout = 10*limit + 2*time.Minute
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "weightd-bench-podready-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	if o.weightd == "" {
		o.weightd = filepath.Join(work, "weightd")
		log.Print("building weightd")
		if out, err := exec.CommandContext(ctx, "go", "build", "-o", o.weightd, "./cmd/weightd").CombinedOutput(); err != nil {
			return fmt.Errorf("building weightd (run from the repository root, or pass -weightd): %w\n%s", err, out)
		}
	}

	originDir := filepath.Join(work, "origin")
	if _, err := genmodel.Generate(originDir, genmodel.Spec{Name: "bench/pod-ready", Files: o.files, TotalBytes: size, Seed: 1}); err != nil {
		return err
	}

	start := time.Now()
	tb, err := testbed.New(ctx, testbed.Config{Name: fmt.Sprintf("podready-%d", os.Getpid()), Hosts: 3, LinkMbit: o.linkMbit})
	if err != nil {
		return err
	}
	defer func() {
		if err := tb.Close(); err != nil {
			log.Print(err)
		}
	}()
	hosts := tb.Hosts()
	originHost, hostA, hostB := hosts[0], hosts[1], hosts[2]
	log.Printf("testbed %s: origin %s, %s %s, %s %s at %d Mbit/s, up in %v; model of %d MiB in %d files, limit S/B = %.2fs",
		tb.Name(), originHost.Addr, nodeA, hostA.Addr, nodeB, hostB.Addr, o.linkMbit,
		time.Since(start).Round(time.Millisecond), o.sizeMiB, o.files, limit.Seconds())

	// The API server, also served in the origin host's namespace.
	start = time.Now()
	env, err := kubetest.Start(ctx, kubetest.Config{Netns: originHost.NS, NetnsAddr: originHost.Addr.String()})
	if err != nil {
		return err
	}
	defer func() {
		if err := env.Close(); err != nil {
			log.Print(err)
		}
	}()
	for _, n := range []string{nodeA, nodeB} {
		if _, err := env.CreateNode(ctx, n, nil); err != nil {
			return err
		}
	}
	// The PrefetchPolicy CRD, as the DaemonSet's install has it: without
	// it the agents' policy controllers retry their list all along.
	dyn, err := dynamic.NewForConfig(env.Config)
	if err != nil {
		return err
	}
	if err := policy.InstallCRD(ctx, dyn); err != nil {
		return err
	}
	log.Printf("API server up in %v, at %s for the hosts", time.Since(start).Round(time.Millisecond), env.NetnsHost)

	addr := netip.AddrPortFrom(originHost.Addr, originPort)
	ref := "http://" + addr.String() + "/" + genmodel.ManifestName
	control := filepath.Join(work, "origin.sock")
	stopOrigin, err := benchnet.StartOrigin(ctx, originHost, exe, originDir, addr.String(), control)
	if err != nil {
		return err
	}
	defer stopOrigin()

	agentsDir := filepath.Join(work, "agents")
	if err := os.Mkdir(agentsDir, 0o755); err != nil {
		return err
	}
	start = time.Now()
	agents, err := benchnet.StartAgents(ctx, []*testbed.Host{hostA, hostB}, benchnet.AgentConfig{
		Bin: o.weightd, Dir: agentsDir, ChunkMiB: o.chunkMiB, Nodes: []string{nodeA, nodeB},
		Kubeconfig: env.NetnsKubeconfig, Extra: strings.Fields(o.agentArgs),
	})
	if err != nil {
		return err
	}
	defer agents.Close()
	a, b := agents.List[0], agents.List[1]
	log.Printf("agents on %s and %s up and joined in %v", nodeA, nodeB, time.Since(start).Round(time.Millisecond))

	// node-a takes the model from the origin.
	fctx, cancel := context.WithTimeout(ctx, o.timeout)
	took, err := a.Fetch(fctx, ref, nil)
	cancel()
	if err != nil {
		return fmt.Errorf("%s fetching the model from the origin: %w", nodeA, err)
	}
	log.Printf("%s holds the model: %.2fs from the origin (%.2f × S/B)", nodeA, took.Seconds(), took.Seconds()/limit.Seconds())
	syscall.Sync() // node-a's write-back must not slow the measurement
	// Let node-a's holdings and node state settle (gossip, its node
	// labels) before the pod arrives.
	select {
	case <-time.After(2 * time.Second):
	case <-ctx.Done():
		return ctx.Err()
	}
	originBefore, err := benchnet.OriginBytes(ctx, control)
	if err != nil {
		return err
	}

	m, err := measure(ctx, env, b, ref, o.timeout)
	if err != nil {
		return err
	}

	originAfter, err := benchnet.OriginBytes(ctx, control)
	if err != nil {
		return err
	}
	metrics, err := scrapeMetrics(ctx, b)
	if err != nil {
		return err
	}
	fromPeers := sumMetric(metrics, "weightd_p2p_received_bytes_total", `source="peer"`)
	fromOrigin := sumMetric(metrics, "weightd_p2p_received_bytes_total", `source="origin"`)

	m.report(limit, size)
	log.Printf("%s received %d bytes from peers and %d from the origin; the origin sent %d bytes meanwhile (the manifest included)",
		nodeB, fromPeers, fromOrigin, originAfter-originBefore)

	secs := m.ready.Sub(m.created).Seconds()
	return json.NewEncoder(os.Stdout).Encode(result{
		Bench:          "pod-ready",
		SizeBytes:      size,
		Seconds:        benchfig.Round(secs, 3),
		LimitS:         benchfig.Round(limit.Seconds(), 3),
		TimeRatio:      benchfig.Round(secs/limit.Seconds(), 3),
		LinkMbit:       o.linkMbit,
		FromPeersBytes: fromPeers,
		OriginBytes:    fromOrigin,
	})
}

// timeline is what one measurement saw, all on this machine's clock.
type timeline struct {
	created  time.Time           // just before the pod's create request
	statuses []timedStatus       // the status annotation's values as the watch saw them
	ready    time.Time           // when the watch saw ready
	job      *prefetch.JobStatus // node-b's job, as its API reported it last
	jobSeen  time.Time           // when the bench first saw node-b's job
	firstB   time.Time           // when the bench first saw it with bytes done
}

type timedStatus struct {
	at     time.Time
	status string
}

// measure creates the pod bound to node-b and returns once its status
// annotation says ready (an error if it says failed, or after timeout).
// Meanwhile it polls node-b's API for the job the pod made, for the
// breakdown.
func measure(ctx context.Context, env *kubetest.Env, b *benchnet.Agent, ref string, timeout time.Duration) (*timeline, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	pods := env.Clientset().CoreV1().Pods(metav1.NamespaceDefault)
	tl := &timeline{}

	// The job on node-b, polled through its API.
	jobDone := make(chan struct{})
	pollCtx, stopPoll := context.WithCancel(ctx)
	go func() {
		defer close(jobDone)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-pollCtx.Done():
				return
			case <-tick.C:
			}
			jobs, err := b.Client.Jobs(pollCtx)
			if err != nil {
				continue
			}
			for i := range jobs {
				j := jobs[i]
				if j.Priority != prefetch.PriorityPod {
					continue
				}
				now := time.Now()
				if tl.jobSeen.IsZero() {
					tl.jobSeen = now
				}
				if tl.firstB.IsZero() && j.BytesDone > 0 {
					tl.firstB = now
				}
				tl.job = &j
				if j.State.Finished() {
					return
				}
			}
		}
	}()
	defer func() {
		stopPoll()
		<-jobDone
	}()

	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: podName, Annotations: map[string]string{podrequest.Models: ref}},
		Spec: corev1.PodSpec{
			NodeName:   nodeB,
			Containers: []corev1.Container{{Name: "server", Image: "vllm/vllm-openai:v0.11.0"}},
		},
	}
	tl.created = time.Now()
	created, err := pods.Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("creating the pod: %w", err)
	}
	w, err := pods.Watch(ctx, metav1.ListOptions{
		FieldSelector:   fields.OneTermEqualSelector("metadata.name", podName).String(),
		ResourceVersion: created.ResourceVersion,
	})
	if err != nil {
		return nil, fmt.Errorf("watching the pod: %w", err)
	}
	defer w.Stop()
	last := ""
	for {
		var ev watch.Event
		var ok bool
		select {
		case ev, ok = <-w.ResultChan():
		case <-ctx.Done():
			return nil, fmt.Errorf("the pod is not ready after %v (status %q)", timeout, last)
		}
		now := time.Now()
		if !ok {
			return nil, fmt.Errorf("the pod's watch ended (status %q)", last)
		}
		if ev.Type == watch.Error {
			return nil, fmt.Errorf("watching the pod: %v", ev.Object)
		}
		p, isPod := ev.Object.(*corev1.Pod)
		if !isPod {
			continue
		}
		status := p.Annotations[podrequest.Status]
		if status == last {
			continue
		}
		last = status
		tl.statuses = append(tl.statuses, timedStatus{at: now, status: status})
		switch {
		case status == kube.StatusReady:
			tl.ready = now
			// Wait for the poller's last look at the job (it stops at
			// once if the job is finished; otherwise cut it short).
			select {
			case <-jobDone:
			case <-time.After(500 * time.Millisecond):
			}
			return tl, nil
		case strings.HasPrefix(status, kube.StatusFailed):
			return nil, fmt.Errorf("the pod's model failed: %s", status)
		}
	}
}

// report logs where the time went.
func (tl *timeline) report(limit time.Duration, size int64) {
	at := func(t time.Time) string {
		if t.IsZero() {
			return "?"
		}
		return fmt.Sprintf("%6.3fs", t.Sub(tl.created).Seconds())
	}
	for _, s := range tl.statuses {
		log.Printf("  %s  pod status %q", at(s.at), s.status)
	}
	total := tl.ready.Sub(tl.created)
	j := tl.job
	if j == nil {
		log.Printf("pod ready in %.3fs (%.2f × S/B); the bench never saw node-b's job", total.Seconds(), total.Seconds()/limit.Seconds())
		return
	}
	log.Printf("  %s  job created on %s (the intake took the pod)", at(j.Created), nodeB)
	log.Printf("  %s  job started", at(j.Started))
	log.Printf("  %s  first verified bytes seen (polling every 10 ms)", at(tl.firstB))
	log.Printf("  %s  job finished (%s, %d of %d bytes)", at(j.Finished), j.State, j.BytesDone, j.BytesTotal)
	log.Printf("  %s  pod status ready seen by the bench's watch", at(tl.ready))
	if !j.Finished.IsZero() && !j.Created.IsZero() {
		intake := j.Created.Sub(tl.created)
		transfer := j.Finished.Sub(j.Created)
		write := tl.ready.Sub(j.Finished)
		log.Printf("pod ready in %.3fs = %.2f × S/B (%.3fs): intake %.3fs + job %.3fs (%.2f × S/B, %.0f Mbit/s) + status write %.3fs; gap to the limit %.3fs",
			total.Seconds(), total.Seconds()/limit.Seconds(), limit.Seconds(),
			intake.Seconds(), transfer.Seconds(), transfer.Seconds()/limit.Seconds(),
			float64(size)*8/transfer.Seconds()/1e6, write.Seconds(), (total - limit).Seconds())
		if !tl.firstB.IsZero() && !j.Started.IsZero() {
			log.Printf("  of the job: queued %.3fs, from start to the first verified bytes seen %.3fs, then %.3fs to the end",
				j.Started.Sub(j.Created).Seconds(), tl.firstB.Sub(j.Started).Seconds(), j.Finished.Sub(tl.firstB).Seconds())
		}
	}
}
