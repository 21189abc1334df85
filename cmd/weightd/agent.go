package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/alecthomas/kong"

	"github.com/weightd/weightd/internal/agent"
)

// agentCmd runs the agent.
type agentCmd struct {
	ConfigFile kong.ConfigFlag `name:"config" help:"YAML configuration file; its keys are the flag names under an 'agent:' section." type:"existingfile" placeholder:"FILE" env:"WEIGHTD_CONFIG"`
	agent.Config
	LogLevel  slog.Level `help:"Log level: debug, info, warn or error." default:"info" env:"WEIGHTD_LOG_LEVEL"`
	LogFormat string     `help:"Log format: text or json." default:"text" enum:"text,json" env:"WEIGHTD_LOG_FORMAT"`
}

func (c *agentCmd) Run(e *env) error {
	log := newLogger(e.stderr, c.LogLevel, c.LogFormat)
	tp, shutdownTracing, err := agent.NewTracerProvider(e.ctx, c.TracingConfig, c.NodeName, version)
	if err != nil {
		return err
	}
	defer func() {
		// Flush the spans batched so far; the agent's context is over.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := shutdownTracing(ctx); err != nil {
			log.Warn("flushing traces", "err", err)
		}
	}()
	cfg := c.Config
	cfg.TracerProvider, cfg.Version, cfg.Commit = tp, version, commit
	a, err := agent.New(cfg, log)
	if err != nil {
		return err
	}
	log.Info("weightd agent starting", "version", version, "root", c.Root, "api", c.API, "metrics", a.MetricsAddr())
	return a.Run(e.ctx)
}
