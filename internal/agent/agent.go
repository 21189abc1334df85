package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"sync/atomic"
	"time"

	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/hf"
	corev1 "k8s.io/api/core/v1"

	gonvml "github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/loadtrace"
	"github.com/weightd/weightd/pkg/mirror"
	"github.com/weightd/weightd/pkg/nvml"
	"github.com/weightd/weightd/pkg/p2p"
	"github.com/weightd/weightd/pkg/pagecache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/warmpool"
)

// Config is the agent's configuration; the agent command fills it from
// flags, WEIGHTD_* environment variables and the YAML file (hence the kong
// tags), the demo, benchmarks and tests set it directly.
type Config struct {
	Root            string        `help:"Cache root directory." default:"/var/lib/weightd" env:"WEIGHTD_ROOT" type:"path"`
	API             string        `name:"api" help:"Local API address: unix:///path.sock or tcp://127.0.0.1:PORT (a loopback address unless --api-allow-remote)." default:"${default_api}" env:"WEIGHTD_API"`
	APIAllowRemote  bool          `name:"api-allow-remote" help:"Allow a tcp:// API address that is not loopback. The API has no authentication: whatever reaches the address can fetch, cancel and read every job." env:"WEIGHTD_API_ALLOW_REMOTE"`
	MetricsAddr     string        `help:"Address of the Prometheus /metrics server; empty disables it." default:"127.0.0.1:9464" env:"WEIGHTD_METRICS_ADDR"`
	PprofAddr       string        `help:"Loopback address (such as 127.0.0.1:6060) of Go's profiles under /debug/pprof/, never served on the metrics address, which Prometheus reaches from the network; empty disables them." env:"WEIGHTD_PPROF_ADDR"`
	ChunkSize       bytesize.Size `help:"Chunk size: the unit of transfer, verification and resume (a multiple of 64KiB)." default:"16MiB" env:"WEIGHTD_CHUNK_SIZE"`
	BudgetBytes     bytesize.Size `help:"Most bytes the cache may use; 0 for no byte limit." default:"0" env:"WEIGHTD_BUDGET_BYTES"`
	BudgetPercent   float64       `help:"Most the cache may use, in percent of its filesystem; 0 for no limit." default:"80" env:"WEIGHTD_BUDGET_PERCENT"`
	MinFreeBytes    bytesize.Size `help:"Least free space the cache leaves on its filesystem, in bytes; the larger of this and --min-free-percent applies." default:"0" env:"WEIGHTD_MIN_FREE_BYTES"`
	MinFreePercent  float64       `help:"Least free space the cache leaves on its filesystem, in percent of its size: by default the kubelet's eviction threshold (nodefs.available 10%) plus 5 points; 0 for no floor." default:"15" env:"WEIGHTD_MIN_FREE_PERCENT"`
	MaxJobs         int           `help:"Prefetch jobs run at once." default:"2" env:"WEIGHTD_MAX_JOBS"`
	ShutdownTimeout time.Duration `help:"How long open API and metrics requests may take to finish at shutdown." default:"15s" env:"WEIGHTD_SHUTDOWN_TIMEOUT"`
	ModelLabels     int           `help:"How many models keep their name in the model label of weightd_prefetch_ready_seconds; later ones count as \"other\"." default:"50" env:"WEIGHTD_MODEL_LABELS"`
	ProcRoot        string        `help:"Where processes' cgroups are read to map GPU processes to pods: the host's /proc (in a pod: with hostPID)." default:"/proc" env:"WEIGHTD_PROC_ROOT"`
	P2PConfig
	SourcesConfig
	ImportConfig
	MirrorConfig
	KubeConfig
	WarmConfig
	LoadTraceConfig
	TracingConfig
	CSIConfig
	// TracerProvider is what components trace with; nil: no tracing. The
	// agent command builds it from TracingConfig.
	TracerProvider trace.TracerProvider `kong:"-"`
	// NVML is the NVML the GPU inventory reads; nil: the system's.
	// Tests set a fake machine.
	NVML gonvml.Interface `kong:"-"`
	// Version and Commit name the build (User-Agents, peers' metadata,
	// weightd_build_info); empty: "dev", as an unstamped binary says.
	Version string `kong:"-"`
	Commit  string `kong:"-"`
}

// Agent is the wired node agent: cache, prefetch queue, local API and
// metrics. Build it with New, then call Run once.
type Agent struct {
	cfg     Config
	log     *slog.Logger
	store   *cache.Store
	queue   *prefetch.Queue
	api     http.Handler
	apiLn   net.Listener
	metrics http.Handler
	metLn   net.Listener // nil when metrics are disabled
	pprofLn net.Listener // nil when profiles are not served
	peers   *peering     // nil when sharing with peers is disabled
	peerRun []func(context.Context) error
	mirror  *nodeMirror          // nil when the registry mirror is disabled
	hosts   *mirrorCheck         // nil when the mirror writes no hosts.toml
	imports *containerd.Importer // nil when images are not imported
	kube    *kubeSide            // nil when Kubernetes features are off
	gpus    *nvml.Inventory      // nil without an NVIDIA driver
	warm    *warmpool.Pool       // nil when the warm pool is off
	dram    *pagecache.Tier      // nil without a DRAM budget for warm bases
	loads   *loadtrace.Tracer    // nil when the load tracer is off
	csi     *csi.Server          // nil when the CSI plugin is off
	reg     *prometheus.Registry // every component's metrics
	running atomic.Bool
}

// zoneLookupTimeout bounds reading the Node's zone at start: an API server
// that does not answer leaves the swarm without zones, not the node
// without an agent.
const zoneLookupTimeout = 10 * time.Second

// New opens the cache, builds every component on one Prometheus
// registry and opens the API and metrics listeners. Without --zone, the
// zone is the Node's topology.kubernetes.io/zone label. It starts no component:
// only, with a cluster, the shared event broadcaster, which Run stops.
func New(cfg Config, log *slog.Logger) (_ *Agent, err error) {
	if cfg.MaxJobs < 1 {
		return nil, fmt.Errorf("--max-jobs must be at least 1, not %d", cfg.MaxJobs)
	}
	if cfg.ShutdownTimeout <= 0 {
		return nil, fmt.Errorf("--shutdown-timeout must be positive, not %v", cfg.ShutdownTimeout)
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	if cfg.Commit == "" {
		cfg.Commit = "dev"
	}
	kc, err := connect(cfg.KubeConfig, cfg.NodeName, cfg.Version, log)
	if err != nil {
		return nil, err
	}
	if cfg.Zone == "" && kc != nil {
		ctx, cancel := context.WithTimeout(context.Background(), zoneLookupTimeout)
		zone, err := kc.zone(ctx)
		cancel()
		switch {
		case err != nil:
			log.Warn("this node's zone is unknown: the swarm leaves zones out until --zone is set or the agent restarts", "err", err)
		case zone != "":
			cfg.Zone = zone
			log.Info("zone from the Node's label", "zone", zone, "label", corev1.LabelTopologyZone)
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		BuildInfo(cfg.Version, cfg.Commit),
	)
	a := &Agent{cfg: cfg, log: log, reg: reg}
	// Undo what was opened if a later step fails.
	defer func() {
		if err != nil {
			a.closeListeners()
			if a.store != nil {
				a.store.Close()
			}
			if a.gpus != nil {
				a.gpus.Close()
			}
			a.kube.close()
		}
	}()

	gpuLog := log.With("component", "gpu")
	lib := cfg.NVML
	if lib == nil {
		lib = gonvml.New()
	}
	a.gpus = openGPUs(lib, cfg.ProcRoot, gpuLog)
	if err = nvml.RegisterMetrics(reg, a.gpus); err != nil {
		return nil, err
	}

	if a.peers, err = newPeering(cfg.P2PConfig, cfg.Version, log, reg); err != nil {
		return nil, err
	}
	storeOpts := []cache.Option{
		cache.WithChunkSize(int64(cfg.ChunkSize)),
		cache.WithBudget(int64(cfg.BudgetBytes), cfg.BudgetPercent),
		cache.WithMinFree(int64(cfg.MinFreeBytes), cfg.MinFreePercent),
		cache.WithLogger(log.With("component", "cache")),
		cache.WithRegisterer(reg),
	}
	if a.peers != nil {
		storeOpts = append(storeOpts, cache.WithEvents(p2p.Announcer(a.peers.membership, log.With("component", "p2p"))))
	}
	a.store, err = cache.Open(cfg.Root, storeOpts...)
	if err != nil {
		return nil, fmt.Errorf("opening cache: %w", err)
	}
	var shared hf.SharedResolver
	if a.peers != nil {
		shared = a.peers.sharedResolve
	}
	sources, oci, err := cfg.sources(shared, cfg.MirrorRegistries, cfg.Version, log.With("component", "prefetch"))
	if err != nil {
		return nil, err
	}
	var src source.Source = sources
	var blobSource mirror.BlobSource
	if a.peers != nil {
		src = a.peers.source(src, log.With("component", "p2p"))
		blobSource = a.peers.blobSource
		if a.peerRun, err = a.peers.serve(a.store, cfg.P2PConfig, cfg.Version, log, reg); err != nil {
			return nil, err
		}
	}
	queueOpts := []prefetch.QueueOption{
		prefetch.WithJobConcurrency(cfg.MaxJobs),
		prefetch.WithLogger(log.With("component", "prefetch")),
		prefetch.WithRegisterer(reg),
		prefetch.WithModelLabels(cfg.ModelLabels),
	}
	if cfg.TracerProvider != nil {
		queueOpts = append(queueOpts, prefetch.WithTracerProvider(cfg.TracerProvider))
	}
	if a.loads, err = cfg.loadTracer(cfg.Root, log.With("component", "loadtrace"), reg); err != nil {
		return nil, err
	}
	if a.loads != nil {
		queueOpts = append(queueOpts, prefetch.WithFileOrder(a.loads))
	}
	if a.imports, err = cfg.importer(a.store, cfg.Platform, log.With("component", "containerd"), reg); err != nil {
		return nil, err
	}
	if a.mirror, err = newMirror(cfg.MirrorConfig, a.store, oci, blobSource, log.With("component", "mirror"), reg); err != nil {
		return nil, err
	}
	if a.imports != nil || a.mirror != nil {
		sink := imageSink{importer: a.imports, log: log.With("component", "images")}
		if a.mirror != nil {
			sink.mirror = a.mirror.handler
		}
		var imp prefetch.Importer = sink
		if a.imports != nil {
			imp = streamingSink{sink}
		}
		queueOpts = append(queueOpts, prefetch.WithImporter(imp))
	}
	a.queue = prefetch.NewQueue(a.store, src, queueOpts...)
	if a.dram, err = newDRAMTier(cfg.WarmConfig, log.With("component", "dram-tier"), reg); err != nil {
		return nil, err
	}
	if a.warm, err = newWarmPool(cfg.WarmConfig, cfg.Root, a.queue, a.store, a.dram, nvml.PodUse(a.gpus, gpuLog), log.With("component", "warmpool"), reg); err != nil {
		return nil, err
	}
	var among amongFirst // without gossip, every agent campaigns
	if a.peers != nil {
		among = a.peers.membership.AmongFirst
	}
	if a.kube, err = newKube(kc, cfg.KubeConfig, cfg.Version, a.queue, a.store, a.warm, among, log, reg); err != nil {
		return nil, err
	}
	if a.csi, err = newCSI(cfg.CSIConfig, cfg.Root, cfg.NodeName, cfg.Version, a.store, a.queue, a.kube.announceVolume(), log.With("component", "csi")); err != nil {
		return nil, err
	}
	var nodeEvent func(eventType, reason, message string) bool
	if a.kube != nil {
		nodeEvent = a.kube.nodeEvent
	}
	if a.hosts, err = newMirrorCheck(a.mirror, cfg.ContainerdAddress, nodeEvent, log.With("component", "mirror"), reg); err != nil {
		return nil, err
	}
	apiOpts := []api.Option{
		api.WithVersion(cfg.Version),
		api.WithReadiness(a.ready),
		api.WithLogger(log.With("component", "api")),
		api.WithRegisterer(reg),
	}
	if a.peers != nil {
		apiOpts = append(apiOpts, api.WithPeers(a.peers.list))
	}
	var warmServers func() []api.WarmServer
	if a.warm != nil {
		warmServers = a.warm.Servers
		apiOpts = append(apiOpts, api.WithAdapters(a.warm), api.WithWarmServers(warmServers))
	}
	if a.gpus != nil {
		apiOpts = append(apiOpts, api.WithGPUs(nvml.APIGPUs(a.gpus, warmServers, gpuLog)))
	}
	if a.loads != nil {
		apiOpts = append(apiOpts, api.WithModelLoads(a.loads.Loads))
	}
	if a.mirror != nil {
		apiOpts = append(apiOpts, api.WithMirror(func() api.MirrorStatus { return a.mirror.status(a.hosts) }))
	}
	if a.csi != nil {
		apiOpts = append(apiOpts, api.WithVolumes(csiVolumes(a.csi, log.With("component", "csi"))))
	}
	if a.api, err = api.NewServer(api.QueueJobs(a.queue), a.store, apiOpts...); err != nil {
		return nil, err
	}
	if network, address, err := api.ParseAddr(cfg.API); err == nil && network == "tcp" && !cfg.APIAllowRemote && !isLoopbackHost(address) {
		return nil, fmt.Errorf("--api %s is not a loopback address: the API has no authentication, so anything that reaches it could fetch and cancel; use a unix socket or 127.0.0.1, or pass --api-allow-remote", cfg.API)
	}
	if a.apiLn, err = api.Listen(cfg.API); err != nil {
		return nil, fmt.Errorf("listening for the API: %w", err)
	}
	if cfg.MetricsAddr != "" {
		if a.metLn, err = net.Listen("tcp", cfg.MetricsAddr); err != nil {
			return nil, fmt.Errorf("listening for metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		a.metrics = mux
	}
	if cfg.PprofAddr != "" {
		// Profiles show memory and stacks, and a CPU profile costs CPU:
		// only the node itself may ask.
		if !isLoopbackHost(cfg.PprofAddr) {
			return nil, fmt.Errorf("--pprof-addr %s is not a loopback address: profiles are served on loopback only", cfg.PprofAddr)
		}
		if a.pprofLn, err = net.Listen("tcp", cfg.PprofAddr); err != nil {
			return nil, fmt.Errorf("listening for profiles: %w", err)
		}
	}
	return a, nil
}

// pprofHandler serves Go's profiles under /debug/pprof/.
func pprofHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// BuildInfo is weightd_build_info{version, commit, goversion} = 1; the
// extender registers it too.
func BuildInfo(version, commit string) prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "weightd_build_info",
		Help: "Always 1; its labels say which weightd build runs.",
	}, []string{"version", "commit"})
	g.WithLabelValues(version, commit).Set(1)
	return g
}

// MetricsAddr is the address /metrics is served on ("" when disabled).
func (a *Agent) MetricsAddr() string {
	if a.metLn == nil {
		return ""
	}
	return a.metLn.Addr().String()
}

// Membership is the agent's gossip membership, nil when sharing with peers
// is off: the demo waits on it for its agents to find each other.
func (a *Agent) Membership() *p2p.Membership {
	if a.peers == nil {
		return nil
	}
	return a.peers.membership
}

// ready is the API's readiness check: the prefetch queue is running and
// the CSI plugin, when on, listens.
func (a *Agent) ready(context.Context) error {
	if !a.running.Load() {
		return errors.New("prefetch queue is not running")
	}
	if a.csi != nil && !a.csi.Listening() {
		return errors.New("CSI plugin is not listening yet")
	}
	return nil
}

// Run runs every component until ctx ends or one of them fails, shuts the
// servers down gracefully, and closes the cache.
func (a *Agent) Run(ctx context.Context) error {
	defer context.AfterFunc(ctx, func() {
		a.log.Info("shutting down gracefully; a second SIGINT or SIGTERM exits at once", "cause", context.Cause(ctx))
	})()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		a.running.Store(true)
		defer a.running.Store(false)
		return a.queue.Run(gctx)
	})
	g.Go(func() error { return ServeHTTP(gctx, a.apiLn, a.api, a.cfg.ShutdownTimeout, a.log) })
	if a.metLn != nil {
		g.Go(func() error { return ServeHTTP(gctx, a.metLn, a.metrics, a.cfg.ShutdownTimeout, a.log) })
	}
	if a.pprofLn != nil {
		g.Go(func() error { return ServeHTTP(gctx, a.pprofLn, pprofHandler(), a.cfg.ShutdownTimeout, a.log) })
	}
	for _, run := range a.peerRun {
		g.Go(func() error { return run(gctx) })
	}
	if a.warm != nil {
		g.Go(func() error { return a.warm.Run(gctx) })
	}
	if a.csi != nil {
		g.Go(func() error { return a.csi.Run(gctx) })
	}
	if a.dram != nil {
		g.Go(func() error { return a.dram.Run(gctx) })
	}
	if a.loads != nil {
		g.Go(func() error {
			// The agent works without the tracer: a failing one stops alone.
			if err := a.loads.Run(gctx); err != nil {
				a.log.Error("model-load tracer stopped", "err", err)
			}
			return nil
		})
	}
	for _, run := range a.kube.runs() {
		g.Go(func() error { return run(gctx) })
	}
	if a.mirror != nil {
		if err := a.mirror.configureHosts(a.cfg.InsecureRegistries); err != nil {
			a.log.Error("writing containerd hosts.toml for the mirror; the kubelet's pulls bypass it", "err", err)
		}
		if a.hosts != nil {
			g.Go(func() error { return a.hosts.Run(gctx) })
		}
		g.Go(func() error {
			return a.mirror.run(gctx, func(ctx context.Context, ln net.Listener, h http.Handler) error {
				return ServeHTTP(ctx, ln, h, a.cfg.ShutdownTimeout, a.log)
			})
		})
	}
	err := g.Wait()
	a.kube.close()
	if a.imports != nil {
		if cerr := a.imports.Close(); cerr != nil {
			a.log.Warn("closing the containerd connection", "err", cerr)
		}
	}
	if a.gpus != nil {
		if cerr := a.gpus.Close(); cerr != nil {
			a.log.Warn("shutting NVML down", "err", cerr)
		}
	}
	if cerr := a.store.Close(); cerr != nil {
		err = errors.Join(err, fmt.Errorf("closing cache: %w", cerr))
	}
	if err != nil {
		a.log.Error("weightd agent stopped", "err", err)
		return err
	}
	a.log.Info("weightd agent stopped")
	return nil
}

func (a *Agent) closeListeners() {
	lns := []net.Listener{a.apiLn, a.metLn, a.pprofLn}
	if a.peers != nil {
		lns = append(lns, a.peers.chunkLn)
	}
	if a.mirror != nil {
		lns = append(lns, a.mirror.ln)
	}
	for _, ln := range lns {
		if ln != nil {
			ln.Close()
		}
	}
}
