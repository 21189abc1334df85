package main

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/weightd/weightd/internal/agent"
	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/cache"
)

// parseArgs parses args like main does and returns the filled command line.
func parseArgs(args ...string) (*cli, string, error) {
	var c cli
	parser, err := newParser(&c, io.Discard, io.Discard, func(int) {})
	if err != nil {
		return nil, "", err
	}
	kctx, err := parser.Parse(args)
	if err != nil {
		return nil, "", err
	}
	return &c, kctx.Command(), nil
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestAgentConfig(t *testing.T) {
	nested := writeFile(t, "nested.yaml", `
agent:
  root: /data/weightd
  api: tcp://127.0.0.1:7000
  chunk-size: 32MiB
  budget-bytes: 1073741824
  budget-percent: 50
  max-jobs: 3
  metrics-addr: ""
  log-level: debug
  log-format: json
`)
	limits := writeFile(t, "limits.yaml", "agent:\n  origin-limit: 1GiB\n  origin-limits:\n    hf: 500MiB\n    registry.example:5000: 0\n")
	flat := writeFile(t, "flat.yaml", "agent-root: /flat\nagent-budget-bytes: 2GiB\n")
	typo := writeFile(t, "typo.yaml", "agent:\n  budget_percent: 50\n")
	defaults := agentCmd{Config: agent.Config{
		Root: "/var/lib/weightd", API: defaultAPI, MetricsAddr: "127.0.0.1:9464", ChunkSize: 16 << 20,
		BudgetPercent: 80, MinFreePercent: cache.DefaultMinFreePercent, MaxJobs: 2, ShutdownTimeout: 15 * time.Second, ModelLabels: 50, ProcRoot: "/proc",
		P2PConfig:       agent.P2PConfig{GossipAddr: ":7946", ChunkAddr: ":7947", OriginFetchers: 2, MaxUploads: 6, UploadTCP: "cubic", PeerCertLifetime: 24 * time.Hour},
		SourcesConfig:   agent.SourcesConfig{HFEndpoint: "https://huggingface.co"},
		ImportConfig:    agent.ImportConfig{ContainerdNamespace: "k8s.io", Snapshotter: "overlayfs"},
		WarmConfig:      agent.WarmConfig{WarmEviction: "lfu"},
		LoadTraceConfig: agent.LoadTraceConfig{LoadTrace: true, CgroupRoot: "/sys/fs/cgroup"},
		TracingConfig:   agent.TracingConfig{OtelSampleRatio: 1},
		CSIConfig:       agent.CSIConfig{KubeletRegistrationDir: "/var/lib/kubelet/plugins_registry", KubeletDir: "/var/lib/kubelet"},
	}, LogLevel: slog.LevelInfo, LogFormat: "text"}

	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    func(c *agentCmd)
		wantErr string
	}{
		{name: "defaults", args: nil, want: func(*agentCmd) {}},
		{
			name: "csi flags and environment",
			args: []string{"--csi-endpoint", "unix:///k/plugins/models.weightd.io/csi.sock", "--kubelet-dir", "/k"},
			env:  map[string]string{"WEIGHTD_KUBELET_REGISTRATION_DIR": "/k/plugins_registry", "WEIGHTD_CSI_ALLOWED_REFS": "team-a=hf://org/"},
			want: func(c *agentCmd) {
				c.CSIConfig = agent.CSIConfig{CSIEndpoint: "unix:///k/plugins/models.weightd.io/csi.sock", KubeletRegistrationDir: "/k/plugins_registry", KubeletDir: "/k", CSIAllowedRefs: "team-a=hf://org/"}
			},
		},
		{
			name: "flags",
			args: []string{"--root", "/r", "--api", "tcp://127.0.0.1:9000", "--metrics-addr=", "--chunk-size", "4MiB",
				"--budget-bytes", "100GB", "--budget-percent", "70.5", "--max-jobs", "8", "--log-level", "warn", "--log-format", "json",
				"--shutdown-timeout", "3s", "--min-free-bytes", "50GiB", "--min-free-percent", "12.5"},
			want: func(c *agentCmd) {
				c.Root, c.API, c.MetricsAddr, c.ChunkSize = "/r", "tcp://127.0.0.1:9000", "", 4<<20
				c.BudgetBytes, c.BudgetPercent, c.MaxJobs = 100e9, 70.5, 8
				c.MinFreeBytes, c.MinFreePercent = 50<<30, 12.5
				c.LogLevel, c.LogFormat, c.ShutdownTimeout = slog.LevelWarn, "json", 3*time.Second
			},
		},
		{
			name: "origin limits",
			args: []string{"--origin-limit", "1GiB", "--origin-limits", "hf=500MiB,Registry.example:5000=0"},
			want: func(c *agentCmd) {
				c.OriginLimit, c.OriginLimits = 1<<30, map[string]bytesize.Size{"hf": 500 << 20, "Registry.example:5000": 0}
			},
		},
		{
			name: "origin limits from the environment",
			env:  map[string]string{"WEIGHTD_ORIGIN_LIMITS": "s3=2GiB"},
			want: func(c *agentCmd) { c.OriginLimits = map[string]bytesize.Size{"s3": 2 << 30} },
		},
		{
			name: "origin limits from the yaml file",
			args: []string{"--config", limits},
			want: func(c *agentCmd) {
				c.ConfigFile = ""
				c.OriginLimit, c.OriginLimits = 1<<30, map[string]bytesize.Size{"hf": 500 << 20, "registry.example:5000": 0}
			},
		},
		{name: "bad origin limit", args: []string{"--origin-limits", "hf=fast"}, wantErr: `--origin-limits: invalid map value "fast"`},
		{
			name: "environment",
			env: map[string]string{"WEIGHTD_ROOT": "/env", "WEIGHTD_CHUNK_SIZE": "1MiB", "WEIGHTD_BUDGET_PERCENT": "10",
				"WEIGHTD_MAX_JOBS": "5", "WEIGHTD_LOG_FORMAT": "json", "WEIGHTD_API": "unix:///tmp/x.sock"},
			want: func(c *agentCmd) {
				c.Root, c.ChunkSize, c.BudgetPercent, c.MaxJobs, c.LogFormat, c.API = "/env", 1<<20, 10, 5, "json", "unix:///tmp/x.sock"
			},
		},
		{
			name: "yaml file",
			args: []string{"--config", nested},
			want: func(c *agentCmd) {
				c.ConfigFile = "" // compared apart
				c.Root, c.API, c.ChunkSize, c.BudgetBytes, c.BudgetPercent = "/data/weightd", "tcp://127.0.0.1:7000", 32<<20, 1<<30, 50
				c.MaxJobs, c.MetricsAddr, c.LogLevel, c.LogFormat = 3, "", slog.LevelDebug, "json"
			},
		},
		{
			name: "yaml file from the environment, flat keys",
			env:  map[string]string{"WEIGHTD_CONFIG": flat},
			want: func(c *agentCmd) { c.ConfigFile, c.Root, c.BudgetBytes = "", "/flat", 2<<30 },
		},
		{
			name: "flag beats environment beats file",
			args: []string{"--config", nested, "--max-jobs", "9"},
			env:  map[string]string{"WEIGHTD_MAX_JOBS": "7", "WEIGHTD_BUDGET_PERCENT": "33"},
			want: func(c *agentCmd) {
				c.ConfigFile = ""
				c.Root, c.API, c.ChunkSize, c.BudgetBytes = "/data/weightd", "tcp://127.0.0.1:7000", 32<<20, 1<<30
				c.MetricsAddr, c.LogLevel, c.LogFormat = "", slog.LevelDebug, "json"
				c.MaxJobs, c.BudgetPercent = 9, 33
			},
		},
		{name: "unknown yaml key", args: []string{"--config", typo}, wantErr: "unknown keys agent-budget_percent"},
		{name: "missing config file", args: []string{"--config", "/nonexistent.yaml"}, wantErr: "nonexistent.yaml"},
		{name: "bad size", args: []string{"--chunk-size", "12 parsecs"}, wantErr: `size "12 parsecs"`},
		{name: "bad log format", args: []string{"--log-format", "xml"}, wantErr: "must be one of"},
		{name: "bad log level", args: []string{"--log-level", "loud"}, wantErr: "loud"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			c, cmd, err := parseArgs(append([]string{"agent"}, tt.args...)...)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cmd != "agent" {
				t.Fatalf("command %q", cmd)
			}
			want := defaults
			tt.want(&want)
			got := c.Agent
			got.ConfigFile = ""
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("got  %+v\nwant %+v", got, want)
			}
		})
	}
}

func TestClientCommandsConfig(t *testing.T) {
	c, cmd, err := parseArgs("fetch", "https://example.com/m/model.json", "--wait", "--json", "--timeout", "5m")
	if err != nil {
		t.Fatal(err)
	}
	want := fetchCmd{Ref: "https://example.com/m/model.json", Priority: "normal", Wait: true, API: defaultAPI, JSON: true, Timeout: 5 * time.Minute}
	if cmd != "fetch <ref>" || c.Fetch != want {
		t.Fatalf("fetch: %q %+v", cmd, c.Fetch)
	}

	t.Setenv("WEIGHTD_API", "tcp://127.0.0.1:7000")
	c, _, err = parseArgs("status", "--json")
	if err != nil {
		t.Fatal(err)
	}
	if c.Status != (statusCmd{API: "tcp://127.0.0.1:7000", JSON: true}) {
		t.Fatalf("status: %+v", c.Status)
	}

	c, _, err = parseArgs("demo", "--size", "512MiB", "--files", "3", "--keep")
	if err != nil {
		t.Fatal(err)
	}
	if c.Demo.Size != 512<<20 || c.Demo.Files != 3 || !c.Demo.Keep || c.Demo.LogLevel != slog.LevelWarn {
		t.Fatalf("demo: %+v", c.Demo)
	}

	if _, _, err := parseArgs("fetch"); err == nil || !strings.Contains(err.Error(), "<ref>") {
		t.Fatalf("fetch without a reference: %v", err)
	}
}
