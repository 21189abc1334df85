package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/genmodel/genmodeltest"
	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

// startAgent runs `weightd agent` in-process on a unix socket until the
// test ends, with what it needs to fetch from the tests' origins on
// loopback and nothing it does not (peers, metrics, the load tracer); it
// returns the API address.
func startAgent(t *testing.T) string {
	t.Helper()
	dir := testdisk.ShortDir(t)
	addr := "unix://" + filepath.Join(dir, "api.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan string, 1)
	go func() {
		var out bytes.Buffer
		if code := run(ctx, []string{"agent", "--root", filepath.Join(dir, "cache"), "--api", addr,
			"--chunk-size", "1MiB", "--budget-percent", "0", "--min-free-percent", "0", "--shutdown-timeout", "5s",
			"--metrics-addr=", "--gossip-addr=", "--no-load-trace", "--fetch-allow-cidrs", "127.0.0.0/8",
		}, &out, &out); code != 0 {
			done <- fmt.Sprintf("exit %d:\n%s", code, out.String())
			return
		}
		done <- ""
	}()
	t.Cleanup(func() {
		cancel()
		if msg := <-done; msg != "" {
			t.Errorf("agent: %s", msg)
		}
	})
	client, err := api.NewClient(addr)
	if err != nil {
		t.Fatal(err)
	}
	readyCtx, cancelReady := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancelReady()
	if err := client.WaitReady(readyCtx); err != nil {
		t.Fatal(err)
	}
	return addr
}

// startOrigin serves a generated model and returns the manifest's URL.
func startOrigin(t *testing.T, files int, size int64) (string, *genmodel.Server) {
	t.Helper()
	o := genmodeltest.Start(t, genmodel.Spec{Name: "test/model", Files: files, TotalBytes: size, Seed: 7})
	return o.Ref(), o.Server
}

// runCLI runs the command line in-process and returns its exit code and output.
func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(t.Context(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestFetchWait(t *testing.T) {
	t.Parallel()
	addr := startAgent(t)
	r, _ := startOrigin(t, 3, 3<<20)

	code, stdout, stderr := runCLI(t, "fetch", "--wait", "--api", addr, r)
	if code != 0 {
		t.Fatalf("exit %d; stderr:\n%s", code, stderr)
	}
	dir := strings.TrimSpace(stdout)
	parsed, err := ref.Parse(r)
	if err != nil {
		t.Fatal(err)
	}
	name := source.ModelName(parsed) // its URL's, not the manifest's "test/model"
	if !strings.Contains(dir, "models--"+strings.ReplaceAll(name, "/", "--")+"/snapshots/") {
		t.Fatalf("stdout %q, want the model directory", stdout)
	}
	if _, err := os.Stat(filepath.Join(dir, "config.json")); err != nil {
		t.Fatal(err)
	}
	// Not a terminal: plain progress lines.
	if !strings.Contains(stderr, "ready "+name+"@") {
		t.Errorf("stderr %q, want a final progress line", stderr)
	}

	code, stdout, _ = runCLI(t, "fetch", "--wait", "--json", "--api", addr, r)
	var st prefetch.JobStatus
	if err := json.Unmarshal([]byte(stdout), &st); code != 0 || err != nil || st.State != prefetch.StateReady || st.Dir != dir {
		t.Fatalf("--json: exit %d, %v, %+v", code, err, st)
	}

	code, stdout, _ = runCLI(t, "fetch", "--api", addr, r)
	if code != 0 || !strings.HasPrefix(stdout, "job ") {
		t.Fatalf("without --wait: exit %d, %q", code, stdout)
	}

	code, stdout, stderr = runCLI(t, "status", "--api", addr)
	if code != 0 || !strings.Contains(stdout, "3 blobs") || !strings.Contains(stdout, "ready") {
		t.Fatalf("status: exit %d\n%s%s", code, stdout, stderr)
	}
	code, stdout, _ = runCLI(t, "status", "--json", "--api", addr)
	var status api.Status
	if err := json.Unmarshal([]byte(stdout), &status); code != 0 || err != nil || status.Cache.Blobs != 3 {
		t.Fatalf("status --json: exit %d, %v, %+v", code, err, status)
	}
}

func TestFetchWaitFails(t *testing.T) {
	t.Parallel()
	addr := startAgent(t)
	notFound := httptest.NewServer(http.NotFoundHandler())
	t.Cleanup(notFound.Close)

	tests := []struct {
		name, ref, stderrHas string
	}{
		{"bad reference", "ftp://example.com/model.json", "parsing reference"},
		{"not a URL", "llama", "parsing reference"},
		{"origin answers 404", notFound.URL + "/model.json", "404"},
		{"file pinned by digest not found", notFound.URL + "/model.bin#sha256:" + strings.Repeat("ab", 32), "404"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := runCLI(t, "fetch", "--wait", "--api", addr, tt.ref)
			if code == 0 || !strings.Contains(stderr, tt.stderrHas) {
				t.Fatalf("exit %d, stderr %q; want a failure mentioning %q", code, stderr, tt.stderrHas)
			}
			if stdout != "" {
				t.Errorf("stdout %q, want nothing", stdout)
			}
		})
	}

	code, _, stderr := runCLI(t, "fetch", "--wait", "--api", "unix:///nonexistent/weightd.sock", "https://example.com/m.json")
	if code == 0 || !strings.Contains(stderr, "nonexistent") {
		t.Fatalf("no agent: exit %d, stderr %q", code, stderr)
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	code, stdout, _ := runCLI(t, "version")
	if code != 0 || !strings.HasPrefix(stdout, "weightd dev (commit dev, go1.") {
		t.Fatalf("exit %d, %q", code, stdout)
	}
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	code, _, stderr := runCLI(t, "frobnicate")
	if code != 2 || !strings.Contains(stderr, "unexpected argument frobnicate") {
		t.Fatalf("unknown command: exit %d, %q", code, stderr)
	}
	code, stdout, _ := runCLI(t, "--help")
	if code != 0 || !strings.Contains(stdout, "Commands:") {
		t.Fatalf("--help: exit %d, %q", code, stdout)
	}
}
