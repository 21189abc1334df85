package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/weightd/weightd/internal/agent"
	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/extender"
	"github.com/weightd/weightd/pkg/kube"
)

// extenderConfig is the scheduler extender's configuration.
type extenderConfig struct {
	Listen          string        `help:"Address to serve the extender (POST /prioritize, /filter), /healthz, /readyz and /metrics on." default:":8888" env:"WEIGHTD_EXTENDER_LISTEN"`
	Kubeconfig      string        `help:"kubeconfig file of the cluster; empty: the in-cluster configuration." env:"WEIGHTD_KUBECONFIG" type:"path"`
	MaxBody         bytesize.Size `help:"Largest extender request body accepted (nodes mode sends whole Node objects)." default:"64MiB" env:"WEIGHTD_EXTENDER_MAX_BODY"`
	ShutdownTimeout time.Duration `help:"How long open requests may take to finish at shutdown." default:"15s" env:"WEIGHTD_SHUTDOWN_TIMEOUT"`
}

// extenderCmd runs the scheduler extender.
type extenderCmd struct {
	extenderConfig
	LogLevel  slog.Level `help:"Log level: debug, info, warn or error." default:"info" env:"WEIGHTD_LOG_LEVEL"`
	LogFormat string     `help:"Log format: text or json." default:"text" enum:"text,json" env:"WEIGHTD_LOG_FORMAT"`
}

func (c *extenderCmd) Run(e *env) error {
	log := newLogger(e.stderr, c.LogLevel, c.LogFormat)
	rc, err := kube.RESTConfig(c.Kubeconfig, 0, 0, "weightd-extender/"+version)
	if err != nil {
		return err
	}
	x, err := newExtenderServer(c.extenderConfig, rc, log)
	if err != nil {
		return err
	}
	log.Info("weightd extender starting", "version", version, "listen", x.Addr(), "api", rc.Host)
	return x.Run(e.ctx)
}

// extenderServer is the wired extender: node watcher, cache, handler and
// HTTP listener. Build it with newExtenderServer, then call Run once.
type extenderServer struct {
	cfg     extenderConfig
	log     *slog.Logger
	watcher *extender.Watcher
	handler http.Handler
	ln      net.Listener
}

// newExtenderServer builds the extender on one Prometheus registry and opens
// its listener. It starts no goroutines.
func newExtenderServer(cfg extenderConfig, rc *rest.Config, log *slog.Logger) (*extenderServer, error) {
	if cfg.ShutdownTimeout <= 0 {
		return nil, fmt.Errorf("--shutdown-timeout must be positive, not %v", cfg.ShutdownTimeout)
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("building the Kubernetes client: %w", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		agent.BuildInfo(version, commit),
	)
	c := extender.NewCache()
	x := &extenderServer{cfg: cfg, log: log, watcher: extender.NewWatcher(client, c, extender.WatchLogger(log.With("component", "watcher")))}
	h, err := extender.NewHandler(c,
		extender.WithLogger(log.With("component", "extender")),
		extender.WithRegisterer(reg),
		extender.WithMaxBodyBytes(int64(cfg.MaxBody)),
	)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/", h)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !x.watcher.Synced() {
			http.Error(w, "node informer not synced", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	x.handler = mux
	if x.ln, err = net.Listen("tcp", cfg.Listen); err != nil {
		return nil, fmt.Errorf("listening for the extender: %w", err)
	}
	return x, nil
}

// Addr is the address the extender serves on.
func (x *extenderServer) Addr() string { return x.ln.Addr().String() }

// Run watches nodes and serves until ctx ends, then shuts the server down
// gracefully.
func (x *extenderServer) Run(ctx context.Context) error {
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return x.watcher.Run(gctx) })
	g.Go(func() error {
		if err := x.watcher.WaitSynced(gctx); err == nil {
			x.log.Info("node informer synced; ready")
		}
		return nil
	})
	g.Go(func() error { return agent.ServeHTTP(gctx, x.ln, x.handler, x.cfg.ShutdownTimeout, x.log) })
	err := g.Wait()
	if err != nil && !errors.Is(err, context.Canceled) {
		x.log.Error("weightd extender stopped", "err", err)
		return err
	}
	x.log.Info("weightd extender stopped")
	return nil
}
