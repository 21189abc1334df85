// Command weightd is the weightd node agent and its command-line client.
//
//	weightd agent            run the agent (cache, prefetch queue, local API, metrics, peers, mirror, Kubernetes,
//	                         warm pool, load tracer)
//	weightd fetch REF --wait fetch a model or image through the local agent, with progress
//	weightd cancel JOB       cancel a fetch job of the local agent
//	weightd status           show the agent's cache, downloads, peers, jobs, GPUs, warm servers and model loads
//	weightd adapter ensure   make a LoRA adapter available on a warm server of its base, through the local agent
//	weightd key REF          print a reference's node label, for a preferred node affinity
//	weightd gpus             print the node's GPUs, MIG instances and GPU processes with their pods (NVML)
//	weightd extender         run the kube-scheduler extender (a Deployment)
//	weightd restore-hosts    put back containerd's hosts.toml files as they were before the agent's mirror (uninstall)
//	weightd demo             run an origin and three agents in-process; they fetch a generated model at once, sharing it
//	weightd version          print the version
//
// Flags can also come from WEIGHTD_* environment variables and, for the
// agent, from a YAML file (--config).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"time"

	"github.com/alecthomas/kong"
	"github.com/weightd/weightd/pkg/api"
)

// Set with -ldflags "-X main.version=... -X main.commit=...".
var (
	version = "dev"
	commit  = "dev"
)

// defaultAPI is where the agent listens and the client connects by default.
const defaultAPI = "unix:///run/weightd/weightd.sock"

// cli is the command line.
type cli struct {
	Agent   agentCmd   `cmd:"" help:"Run the node agent: cache, prefetch queue, local API and metrics."`
	Fetch   fetchCmd   `cmd:"" help:"Fetch a model through the local agent."`
	Cancel  cancelCmd  `cmd:"" help:"Cancel a fetch job of the local agent."`
	Status  statusCmd  `cmd:"" help:"Summarise the agent's cache, downloads and jobs."`
	Adapter adapterCmd `cmd:"" help:"Make a LoRA adapter available on a warm server of this node, through the local agent."`
	Key     keyCmd     `cmd:"" help:"Print the node label of a reference, for a preferred node affinity."`
	GPUs    gpusCmd    `cmd:"" name:"gpus" help:"Print this node's GPUs, MIG instances and GPU processes with their pods, straight from NVML (no agent needed)."`
	Demo    demoCmd    `cmd:"" help:"Run an origin and three agents in-process: they fetch a generated model at once, sharing chunks, then fetch it again from the cache."`
	Version versionCmd `cmd:"" help:"Print the version, commit and Go version."`

	Extender extenderCmd `cmd:"" help:"Run the kube-scheduler extender (a Deployment): score nodes by the pod's models and images they hold."`

	RestoreHosts restoreHostsCmd `cmd:"" name:"restore-hosts" help:"Put back containerd's hosts.toml files on this node as they were before the agent's mirror (the chart's post-delete hook)."`
}

// env is what every command's Run receives: the context (cancelled on the
// first SIGINT or SIGTERM) and the output streams.
type env struct {
	ctx    context.Context
	stdout io.Writer
	stderr io.Writer
}

// client is a client of the agent's API at addr, and the context a command
// asks it in: cut after timeout unless timeout is 0.
func (e *env) client(addr string, timeout time.Duration) (*api.Client, context.Context, context.CancelFunc, error) {
	client, err := api.NewClient(addr)
	if err != nil {
		return nil, nil, nil, err
	}
	if timeout > 0 {
		ctx, cancel := context.WithTimeout(e.ctx, timeout)
		return client, ctx, cancel, nil
	}
	ctx, cancel := context.WithCancel(e.ctx)
	return client, ctx, cancel, nil
}

type versionCmd struct{}

func (versionCmd) Run(e *env) error {
	_, err := fmt.Fprintf(e.stdout, "weightd %s (commit %s, %s, %s/%s)\n", version, commit, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	return err
}

// exitCode carries kong's requested exit (after --help, or a usage error)
// out of the parser.
type exitCode int

// newParser builds the command-line parser. exit is called by kong for
// --help and usage errors.
func newParser(c *cli, stdout, stderr io.Writer, exit func(int)) (*kong.Kong, error) {
	return kong.New(c,
		kong.Name("weightd"),
		kong.Description("weightd prefetches model weights onto GPU nodes and keeps them in a verified local cache."),
		kong.Writers(stdout, stderr),
		kong.Exit(exit),
		kong.Configuration(loadYAMLConfig),
		kong.ConfigureHelp(kong.HelpOptions{Compact: true}),
		kong.Vars{"default_api": defaultAPI},
	)
}

// run parses args and runs the command; it returns the process exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) (code int) {
	var c cli
	defer func() {
		if r := recover(); r != nil {
			ec, ok := r.(exitCode)
			if !ok {
				panic(r)
			}
			code = int(ec)
		}
	}()
	parser, err := newParser(&c, stdout, stderr, func(code int) { panic(exitCode(code)) })
	if err != nil {
		fmt.Fprintln(stderr, "weightd:", err)
		return 2
	}
	kctx, err := parser.Parse(args)
	if err != nil {
		parser.Errorf("%s", err)
		var pe *kong.ParseError
		if errors.As(err, &pe) && pe.Context != nil {
			_ = pe.Context.PrintUsage(true)
		}
		return 2
	}
	if err := kctx.Run(&env{ctx: ctx, stdout: stdout, stderr: stderr}); err != nil {
		fmt.Fprintln(stderr, "weightd:", err)
		if ctx.Err() != nil {
			return 130
		}
		return 1
	}
	return 0
}

func main() {
	ctx, release := signalContext(context.Background(), os.Stderr, os.Exit)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	release()
	os.Exit(code)
}

// signalContext returns a context cancelled on the first SIGINT or SIGTERM,
// so every component can shut down gracefully. A second signal calls
// exit(130) at once: the cache keeps itself consistent (every write is
// atomic), so a hard exit is safe. release stops listening for signals.
func signalContext(parent context.Context, stderr io.Writer, exit func(int)) (context.Context, func()) {
	ctx, stop := signal.NotifyContext(parent, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-done:
			return
		}
		// Subscribe before stop() restores the default disposition, so no
		// signal can kill the process in between.
		second := make(chan os.Signal, 1)
		signal.Notify(second, os.Interrupt, syscall.SIGTERM)
		defer signal.Stop(second)
		stop()
		select {
		case s := <-second:
			fmt.Fprintf(stderr, "weightd: %v again, exiting now\n", s)
			exit(130)
		case <-done:
		}
	}()
	var once sync.Once
	return ctx, func() { once.Do(func() { close(done); stop() }) }
}
