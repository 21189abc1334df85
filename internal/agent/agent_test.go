package agent

import (
	"context"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/genmodel/genmodeltest"
	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/api"
)

// startAgentWith runs an agent, wired by New, with a configuration
// changed by edit (if not nil), on a unix socket until the test ends; it
// returns the API address.
func startAgentWith(t *testing.T, edit func(*Config)) string {
	t.Helper()
	_, addr := startAgentAndAddr(t, edit)
	return addr
}

// startAgentAndAddr is startAgentWith that also returns the agent.
func startAgentAndAddr(t *testing.T, edit func(*Config)) (*Agent, string) {
	t.Helper()
	dir := testdisk.ShortDir(t)
	addr := "unix://" + filepath.Join(dir, "api.sock")
	cfg := Config{
		Root: filepath.Join(dir, "cache"), API: addr, ChunkSize: 1 << 20,
		MaxJobs: 2, ShutdownTimeout: 5 * time.Second,
		// The tests' origins listen on loopback.
		SourcesConfig: SourcesConfig{FetchAllowCIDRs: []string{"127.0.0.0/8"}},
	}
	if edit != nil {
		edit(&cfg)
	}
	return runAgent(t, cfg), addr
}

// runAgent builds an agent from cfg and runs it until the test ends; it
// returns once the agent's API at cfg.API says it is ready.
func runAgent(t *testing.T, cfg Config) *Agent {
	t.Helper()
	a, err := New(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent: %v", err)
		}
	})
	client, err := api.NewClient(cfg.API)
	if err != nil {
		t.Fatal(err)
	}
	readyCtx, cancelReady := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancelReady()
	if err := client.WaitReady(readyCtx); err != nil {
		t.Fatal(err)
	}
	return a
}

// startOrigin serves a generated model and returns the manifest's URL.
func startOrigin(t *testing.T, files int, size int64) (string, *genmodel.Server) {
	t.Helper()
	o := genmodeltest.Start(t, genmodel.Spec{Name: "test/model", Files: files, TotalBytes: size, Seed: 7})
	return o.Ref(), o.Server
}
