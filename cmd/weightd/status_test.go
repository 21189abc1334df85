package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
)

// statusJobs is an api.Jobs that only lists.
type statusJobs struct{ list []prefetch.JobStatus }

func (statusJobs) Submit(string, prefetch.Priority) (prefetch.JobStatus, error) {
	return prefetch.JobStatus{}, content.ErrInvalid
}
func (statusJobs) Cancel(string) (prefetch.JobStatus, bool) { return prefetch.JobStatus{}, false }
func (statusJobs) Status(string) (prefetch.JobStatus, bool) { return prefetch.JobStatus{}, false }
func (statusJobs) Watch(context.Context, string) (<-chan prefetch.JobStatus, bool) {
	return nil, false
}
func (j statusJobs) List() []prefetch.JobStatus { return j.list }

type statusUsage cache.Usage

func (u statusUsage) Usage() cache.Usage { return cache.Usage(u) }

var statusNow = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

// fakeStatus is an agent's status with something in every section, its
// lists out of order.
func fakeStatus() (statusJobs, statusUsage, []api.Option) {
	t0 := statusNow.Add(-time.Hour)
	jobs := statusJobs{list: []prefetch.JobStatus{
		{ID: "00000000000000b2", Ref: "https://origin.example/org/llama/model.json", State: prefetch.StateFetching, Model: "org/llama-3.1-8b-instruct-with-a-very-long-name", Revision: "main",
			BytesDone: 3 << 30, BytesTotal: 12 << 30, FilesDone: 2, FilesTotal: 7, Created: t0.Add(2 * time.Minute)},
		{ID: "00000000000000a1", Ref: "hf://org/tiny@main", State: prefetch.StateReady, Model: "org/tiny", Revision: "main",
			BytesDone: 1 << 20, BytesTotal: 1 << 20, Created: t0.Add(time.Minute), Dir: "/var/lib/weightd/models/models--org--tiny/snapshots/main"},
		{ID: "00000000000000c3", Ref: "oci://registry.example/org/app:v1", State: prefetch.StateFailed, Created: t0.Add(3 * time.Minute),
			Error: "resolving oci://registry.example/org/app:v1:\n401 Unauthorized"},
		{ID: "00000000000000d4", Ref: "hf://org/queued@main", State: prefetch.StateQueued, Created: t0.Add(4 * time.Minute)},
	}}
	usage := statusUsage{
		Root: "/var/lib/weightd", Bytes: 40 << 30, Blobs: 3, PartialBytes: 3 << 30, BudgetBytes: 80 << 30, DiskFree: 200 << 30,
		InFlight: []cache.Flight{
			{Digest: digest.FromString("b"), Size: 8 << 30, Done: 2 << 30, Waiters: 1, HeldFor: 42 * time.Second},
			{Digest: digest.FromString("a"), Size: 4 << 30, Done: 1 << 30, HeldFor: 90 * time.Second},
		},
	}
	opts := []api.Option{
		api.WithVersion("v1.2.3"),
		api.WithPeers(func() []api.Peer {
			return []api.Peer{{Name: "node-c", ChunkAddr: "10.0.0.3:7001"}, {Name: "node-b", ChunkAddr: "10.0.0.2:7001", Zone: "zone-1"}}
		}),
		api.WithGPUs(func() []api.GPU {
			return []api.GPU{
				{Index: 1, UUID: "GPU-2", Name: "NVIDIA H100 80GB HBM3", MemoryTotalBytes: 80 << 30, MemoryUsedBytes: 0},
				{Index: 0, UUID: "GPU-1", Name: "NVIDIA H100 80GB HBM3", MemoryTotalBytes: 80 << 30, MemoryUsedBytes: 20 << 30, Bases: []string{"org/llama"}},
			}
		}),
		api.WithWarmServers(func() []api.WarmServer {
			return []api.WarmServer{
				{Pod: "serving/vllm-llama-0", Base: "org/llama", Runtime: "vllm", Endpoint: "http://10.1.0.5:8000", Healthy: true, Slots: 4, GPUs: []string{"GPU-1"},
					Adapters: []api.LoadedAdapter{
						{Name: "support-bot", LastUsed: statusNow.Add(-5 * time.Minute), InUse: 2},
						{Name: "sql-writer", LastUsed: statusNow.Add(-30 * time.Second), Pinned: true},
					}},
				{Pod: "serving/sglang-qwen-0", Base: "org/qwen", Runtime: "sglang", Healthy: false, Slots: 2, Error: "connection refused"},
			}
		}),
		api.WithVolumes(func() []api.Volume {
			return []api.Volume{
				{ID: "csi-b", Namespace: "team-b", Pod: "reader-0", Name: "model", Ref: "hf://org/tiny@main", Blobs: 3, Bytes: 1 << 20},
				{ID: "csi-a", PodUID: "8d3f2a1c-5b6e-4c7d-9e0f-1a2b3c4d5e6f", Name: "weights", Ref: "oci://registry.example/org/llama:v1", Blobs: 7, Bytes: 12 << 30},
			}
		}),
		api.WithModelLoads(func() []api.ModelLoad {
			return []api.ModelLoad{
				{Pod: "serving/vllm-llama-0", Model: "org/llama@main", Started: statusNow.Add(-2 * time.Hour), Seconds: 41.25, Files: 7},
				{Pod: "serving/sglang-qwen-0", Model: "org/qwen@main", Started: statusNow.Add(-3 * time.Minute), Seconds: 3.5, Files: 4, Open: 1},
			}
		}),
	}
	return jobs, usage, opts
}

// startFakeAgentAPI serves fakeStatus over HTTP; requests counts GET
// /v1/status calls.
func startFakeAgentAPI(t *testing.T, requests *atomic.Int32) string {
	t.Helper()
	jobs, usage, opts := fakeStatus()
	srv, err := api.NewServer(jobs, usage, opts...)
	require.NoError(t, err)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		srv.ServeHTTP(w, r)
		if r.URL.Path == "/v1/status" {
			requests.Add(1)
		}
	}))
	t.Cleanup(hs.Close)
	return hs.URL
}

const wantStatus = `weightd v1.2.3 at http://agent

CACHE
  root       /var/lib/weightd
  used       40.0 GiB in 3 blobs, 50% of the budget
  budget     80.0 GiB
  disk free  200.0 GiB
  partial    3.0 GiB in 2 downloads

DOWNLOADS
  BLOB                 PROGRESS                   BYTES              WAITERS  FOR
  sha256:3e23e8160039  [####--------------]  25%  2.0 GiB / 8.0 GiB  1        42s
  sha256:ca978112ca1b  [####--------------]  25%  1.0 GiB / 4.0 GiB  0        1m30s

PEERS
  NAME    CHUNK ADDRESS  ZONE
  node-b  10.0.0.2:7001  zone-1
  node-c  10.0.0.3:7001  -

JOBS
  ID                STATE     MODEL                         PROGRESS           BYTES
  00000000000000a1  ready     org/tiny@main                 [##########] 100%  1.0 MiB / 1.0 MiB
  00000000000000b2  fetching  org/llama-3.1-8b-instruct-w…  [##--------]  25%  3.0 GiB / 12.0 GiB
  00000000000000c3  failed    oci://registry.example/org/…  -                  -
  00000000000000d4  queued    hf://org/queued@main          -                  -
  00000000000000c3: resolving oci://registry.example/org/app:v1: 401 Unauthorized

VOLUMES
  POD                             VOLUME   MODEL                         SIZE      BLOBS
  pod 8d3f2a1c-5b6e-4c7d-9e0f-1…  weights  oci://registry.example/org/…  12.0 GiB  7
  team-b/reader-0                 model    hf://org/tiny@main            1.0 MiB   3

GPUS
  GPU  NAME                   MEMORY           USED                 WARM BASES
  0    NVIDIA H100 80GB HBM3  [##------]  25%  20.0 GiB / 80.0 GiB  org/llama
  1    NVIDIA H100 80GB HBM3  [--------]   0%  0 B / 80.0 GiB       -

WARM SERVERS
  POD                    BASE       RUNTIME  HEALTH     ADAPTERS
  serving/sglang-qwen-0  org/qwen   sglang   unhealthy  0/2
  serving/vllm-llama-0   org/llama  vllm     healthy    2/4
  serving/sglang-qwen-0: connection refused

ADAPTERS
  SERVER                ADAPTER      LAST USED  IN USE  PINNED
  serving/vllm-llama-0  sql-writer   30s ago    0       yes
  serving/vllm-llama-0  support-bot  5m ago     2       no

MODEL LOADS
  STARTED  POD                    MODEL           SECONDS  FILES
  3m ago   serving/sglang-qwen-0  org/qwen@main   3.5      4 (1 open)
  2h ago   serving/vllm-llama-0   org/llama@main  41.2     7
`

func TestStatusRender(t *testing.T) {
	t.Parallel()
	var requests atomic.Int32
	url := startFakeAgentAPI(t, &requests)
	client, err := api.NewClient(url)
	require.NoError(t, err)
	st, err := client.Status(t.Context())
	require.NoError(t, err)

	var out bytes.Buffer
	renderStatus(&out, st, statusView{api: "http://agent", now: statusNow})
	assert.Equal(t, wantStatus, out.String())
	for _, line := range strings.Split(out.String(), "\n") {
		assert.LessOrEqual(t, utf8.RuneCountInString(line), statusWidth, "%q", line)
	}

	// A terminal gets bold headings; the rest is the same.
	var tty bytes.Buffer
	renderStatus(&tty, st, statusView{api: "http://agent", now: statusNow, tty: true})
	assert.Contains(t, tty.String(), "\x1b[1mCACHE\x1b[0m\n")
	assert.Equal(t, wantStatus, strings.NewReplacer("\x1b[1m", "", "\x1b[0m", "").Replace(tty.String()))
}

func TestStatusRenderEmptyAndLong(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	renderStatus(&out, api.Status{Version: "dev", Cache: cache.Usage{Root: "/c"}}, statusView{api: "unix:///run/weightd.sock", now: statusNow})
	assert.Contains(t, out.String(), "PEERS\n  none\n")
	assert.Contains(t, out.String(), "  budget     no byte budget\n")
	assert.NotContains(t, out.String(), "ADAPTERS")
	assert.NotContains(t, out.String(), "VOLUMES", "a node without the CSI plugin")

	// Many finished jobs: the unfinished and the last few finished are shown.
	var st api.Status
	long := strings.Repeat("x", 300)
	for i := range 20 {
		state := prefetch.StateReady
		if i == 3 {
			state = prefetch.StateFetching
		}
		st.Jobs = append(st.Jobs, prefetch.JobStatus{ID: long[:i+1], Ref: long, State: state, Error: long, Created: statusNow.Add(time.Duration(i) * time.Second)})
	}
	st.Peers = []api.Peer{{Name: long, ChunkAddr: long, Zone: long}}
	st.Warm = []api.WarmServer{{Pod: long, Base: long, Runtime: long, Error: long, Adapters: []api.LoadedAdapter{{Name: long}}}}
	st.GPUs = []api.GPU{{Name: long, Bases: []string{long, long}}}
	st.Loads = []api.ModelLoad{{Pod: long, Model: long}}
	st.Volumes = []api.Volume{{Namespace: long, Pod: long, Name: long, Ref: long}}
	st.Cache.Root = long
	out.Reset()
	renderStatus(&out, st, statusView{api: long, now: statusNow})
	for _, line := range strings.Split(out.String(), "\n") {
		assert.LessOrEqual(t, utf8.RuneCountInString(line), statusWidth, "%q", line)
	}
	assert.Contains(t, out.String(), "(14 older finished jobs not shown; --json lists them)")
	rows := regexp.MustCompile(`(?m)^  [x…]+ +(ready|fetching) `).FindAllString(out.String(), -1)
	assert.Len(t, rows, 6, "the fetching job and 5 finished ones")
}

func TestStatusCommand(t *testing.T) {
	t.Parallel()
	var requests atomic.Int32
	url := startFakeAgentAPI(t, &requests)

	code, stdout, stderr := runCLI(t, "status", "--api", url)
	require.Equal(t, 0, code, stderr)
	assert.True(t, strings.HasPrefix(stdout, "weightd v1.2.3 at "+url+"\n"))
	assert.Contains(t, stdout, "\nWARM SERVERS\n")
	assert.NotContains(t, stdout, "\x1b", "no escape sequences when not a terminal")
	for _, line := range strings.Split(stdout, "\n") {
		assert.LessOrEqual(t, utf8.RuneCountInString(line), statusWidth, "%q", line)
	}

	code, stdout, stderr = runCLI(t, "status", "--json", "--api", url)
	require.Equal(t, 0, code, stderr)
	var st api.Status
	require.NoError(t, json.Unmarshal([]byte(stdout), &st))
	assert.Len(t, st.Warm, 2)
	assert.Len(t, st.Loads, 2)
	assert.Len(t, st.GPUs, 2)

	code, _, stderr = runCLI(t, "status", "--watch", "-1s", "--api", url)
	assert.NotEqual(t, 0, code)
	assert.Contains(t, stderr, "--watch")
}

func TestStatusWatch(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var requests atomic.Int32
	url := startFakeAgentAPI(t, &requests)
	var out, errOut bytes.Buffer
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"status", "--watch", "1ms", "--api", url}, &out, &errOut) }()
	require.Eventually(t, func() bool { return requests.Load() >= 3 }, 30*time.Second, time.Millisecond)
	cancel()
	require.Equal(t, 0, <-done, errOut.String())
	// Not a terminal: each refresh follows the last after a blank line.
	assert.True(t, strings.HasPrefix(out.String(), "\nweightd v1.2.3 at "))
	assert.GreaterOrEqual(t, strings.Count(out.String(), "\n\nweightd v1.2.3 at "), 1)
	assert.NotContains(t, out.String(), "\x1b")
}

func TestRenderMirror(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	// What the agent's mirror check says of containerd 1.6 without a config_path.
	const problem = "containerd 1.6.20's CRI has no registry config_path, so it reads none of the hosts.toml files in /etc/containerd/certs.d: " +
		"the kubelet's pulls bypass the mirror and go straight to the registries; " +
		`set [plugins."io.containerd.grpc.v1.cri".registry] config_path = "/etc/containerd/certs.d" in containerd's config.toml and restart containerd`
	renderStatus(&out, api.Status{Version: "dev", Mirror: &api.MirrorStatus{
		Addr: "127.0.0.1:5001", Registries: []string{"docker.io", "ghcr.io"}, HostsDir: "/etc/containerd/certs.d",
		ConfigPathState: api.ConfigPathUnset, ContainerdVersion: "1.6.20", Problem: problem,
	}}, statusView{api: "unix:///run/weightd.sock", now: statusNow})
	const want = `
MIRROR
  address     127.0.0.1:5001
  registries  docker.io, ghcr.io
  hosts dir   /etc/containerd/certs.d
  containerd  unset
  version     1.6.20
  containerd 1.6.20's CRI has no registry config_path, so it reads none of the hosts.toml files in
  /etc/containerd/certs.d: the kubelet's pulls bypass the mirror and go straight to the registries;
  set [plugins."io.containerd.grpc.v1.cri".registry] config_path = "/etc/containerd/certs.d" in
  containerd's config.toml and restart containerd
`
	assert.Contains(t, out.String(), want)
	for _, line := range strings.Split(out.String(), "\n") {
		assert.LessOrEqual(t, utf8.RuneCountInString(line), statusWidth, "%q", line)
	}

	out.Reset()
	renderStatus(&out, api.Status{Version: "dev", Mirror: &api.MirrorStatus{Addr: "127.0.0.1:5001", Registries: []string{"docker.io"}}},
		statusView{api: "x", now: statusNow})
	assert.Contains(t, out.String(), "  hosts dir   - (no hosts.toml written)\n")
	out.Reset()
	renderStatus(&out, api.Status{Version: "dev"}, statusView{api: "x", now: statusNow})
	assert.NotContains(t, out.String(), "MIRROR")

	long := strings.Repeat("x", 300)
	assert.Equal(t, []string{"a b c", strings.Repeat("x", 9) + "…", "d e f g"}, wrapWords("a b c "+long+" d e f g", 10))
	assert.Equal(t, []string{"abcd", "efgh"}, wrapWords("abcd efgh", 8))
	assert.Empty(t, wrapWords("  ", 10))
}
