package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/prefetch"
)

// demoCleanedUp fails t if what the demo made in dir is still there.
func demoCleanedUp(t *testing.T, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		t.Errorf("%s left behind in %s", e.Name(), dir)
	}
}

func TestDemoAgentsShare(t *testing.T) {
	t.Parallel()
	dir := testdisk.ShortDir(t)
	// 1 MiB chunks: each file is several chunks, so the agents pass chunks
	// on to each other while they download.
	code, stdout, stderr := runCLI(t, "demo", "--files", "3", "--size", "24MiB", "--chunk-size", "1MiB", "--dir", dir)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	for _, want := range []string{
		"3 files, 24.0 MiB (25165824 bytes)",
		"agents         3 in this process, sharing 1.0 MiB chunks peer-to-peer on loopback",
		"all 3 agents at once; origin sent ",
		"second fetch   demo-a ",
		"cache hit",
		"bytes of model fetched 4 times",
		"/demo-a/cache/models/models--127.0.0.1-", // named after the manifest's URL
		"--model.json--",
		"-> ../../../../blobs/sha256/",
		"every agent's holds the same files",
		"demo-c  weightd status --api unix://" + dir + "/demo-c/weightd.sock",
		"demo-b  curl -s http://127.0.0.1:",
		`weightd_prefetch_jobs_total{kind="http",outcome="ready"} 2`,
		"weightd_p2p_peers 2",
	} {
		if !strings.Contains(stdout, want) {
			t.Errorf("summary lacks %q:\n%s", want, stdout)
		}
	}
	// The origin sent about one copy for three agents: the model's three
	// files are 4 KiB, 3 MiB and 21 MiB, so demoOriginBound allows 4 chunks more.
	m := regexp.MustCompile(`origin sent (\d+) bytes, ([\d.]+)× the model`).FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("no origin bytes in the summary:\n%s", stdout)
	}
	if served, _ := strconv.ParseInt(m[1], 10, 64); served < 25165824 || served > 25165824+4<<20 {
		t.Errorf("origin sent %d bytes (%s× the model), want one copy", served, m[2])
	}
	// Every agent reports where its bytes came from, and some came from peers.
	lines := regexp.MustCompile(`(demo-[abc])  [\d.]+ s, [\d.]+ MB/s; received ([^ ]+ [KMG]?i?B) from the origin, ([^ ]+ [KMG]?i?B) from peers`).FindAllStringSubmatch(stdout, -1)
	if len(lines) != 3 {
		t.Fatalf("%d per-agent lines, want 3:\n%s", len(lines), stdout)
	}
	fromPeers := false
	for _, l := range lines {
		fromPeers = fromPeers || l[3] != "0 B"
	}
	if !fromPeers {
		t.Errorf("no agent received anything from its peers:\n%s", stdout)
	}
	if !strings.Contains(stderr, "by all 3 agents at once; progress of demo-a") {
		t.Errorf("stderr lacks the first fetch's progress:\n%s", stderr)
	}
	demoCleanedUp(t, dir)
}

func TestDemoOneAgent(t *testing.T) {
	t.Parallel()
	dir := testdisk.ShortDir(t)
	code, stdout, stderr := runCLI(t, "demo", "--agents", "1", "--files", "2", "--size", "4MiB", "--chunk-size", "1MiB", "--dir", dir)
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	for _, want := range []string{
		"agents         1 (no peers to share with), 1.0 MiB chunks",
		"demo-a  ", "(origin → verified on disk)",
		"cache hit",
		"bytes of model fetched 2 times",
	} {
		if !strings.Contains(stdout, want) {
			t.Errorf("summary lacks %q:\n%s", want, stdout)
		}
	}
	for _, unwanted := range []string{"from peers", "demo-b", "weightd_p2p_"} {
		if strings.Contains(stdout, unwanted) {
			t.Errorf("summary of a lone agent has %q:\n%s", unwanted, stdout)
		}
	}
	demoCleanedUp(t, dir)
}

func TestDemoUsageErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		args      []string
		stderrHas string
	}{
		{[]string{"--agents", "0"}, "--agents must be between 1 and 26, not 0"},
		{[]string{"--agents", "27"}, "--agents must be between 1 and 26, not 27"},
		{[]string{"--files", "0"}, "--files must be at least 1"},
		{[]string{"--chunk-size", "100KiB", "--size", "1MiB"}, "chunk size"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			t.Parallel()
			dir := testdisk.ShortDir(t)
			code, _, stderr := runCLI(t, append([]string{"demo", "--dir", dir}, tt.args...)...)
			if code != 1 || !strings.Contains(stderr, tt.stderrHas) {
				t.Fatalf("exit %d, stderr %q; want a failure mentioning %q", code, stderr, tt.stderrHas)
			}
			demoCleanedUp(t, dir)
		})
	}
}

func TestSample(t *testing.T) {
	t.Parallel()
	samples := []string{
		`weightd_p2p_received_bytes_total{source="origin"} 1.2163345e+08`,
		`weightd_p2p_received_bytes_total{source="peer"} 44039509`,
		`weightd_p2p_broken{source="peer"} NaNish`,
	}
	tests := []struct {
		series string
		want   int64
		err    bool
	}{
		{`weightd_p2p_received_bytes_total{source="origin"}`, 121633450, false},
		{`weightd_p2p_received_bytes_total{source="peer"}`, 44039509, false},
		{`weightd_p2p_received_bytes_total{source="peers"}`, 0, false},
		{`weightd_p2p_received_bytes_total`, 0, false},
		{`weightd_p2p_broken{source="peer"}`, 0, true},
	}
	for _, tt := range tests {
		got, err := sample(samples, tt.series)
		if got != tt.want || (err != nil) != tt.err {
			t.Errorf("sample(%s) = %d, %v; want %d, error %v", tt.series, got, err, tt.want, tt.err)
		}
	}
}

func TestSameModelFiles(t *testing.T) {
	t.Parallel()
	snapshot := func(links map[string]string) string {
		dir := t.TempDir()
		for name, target := range links {
			if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
				t.Fatal(err)
			}
		}
		return dir
	}
	blobA, blobB := "../../../../blobs/sha256/"+strings.Repeat("a", 64), "../../../../blobs/sha256/"+strings.Repeat("b", 64)
	good := map[string]string{"config.json": blobA, "model.safetensors": blobB}
	agents := []*demoAgent{{name: "demo-a"}, {name: "demo-b"}}
	fetches := func(dirs ...string) []demoFetch {
		var out []demoFetch
		for _, d := range dirs {
			out = append(out, demoFetch{status: prefetch.JobStatus{Dir: d}})
		}
		return out
	}
	tests := []struct {
		name  string
		other map[string]string
		files int
		err   string
	}{
		{"same", good, 2, ""},
		{"other blob", map[string]string{"config.json": blobA, "model.safetensors": blobA}, 2, "demo-b's model directory differs from demo-a's"},
		{"missing file", map[string]string{"config.json": blobA}, 2, "demo-b: the model directory"},
		{"fewer than the manifest", good, 3, "demo-a: the model directory"},
	}
	for _, tt := range tests {
		err := sameModelFiles(agents, fetches(snapshot(good), snapshot(tt.other)), tt.files)
		if tt.err == "" && err != nil || tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)) {
			t.Errorf("%s: %v, want an error with %q", tt.name, err, tt.err)
		}
	}
	if err := sameModelFiles(agents, fetches(filepath.Join(t.TempDir(), "gone"), snapshot(good)), 2); err == nil {
		t.Error("no error for a missing model directory")
	}
}
