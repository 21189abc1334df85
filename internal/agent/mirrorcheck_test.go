package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/weightd/weightd/internal/kubetest"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/internal/testdisk"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/kube"
)

const (
	table1 = `[plugins."io.containerd.grpc.v1.cri".registry]`
	table2 = `[plugins."io.containerd.cri.v1.images".registry]`
)

func TestClassifyConfigPath(t *testing.T) {
	t.Parallel()
	const hosts = "/etc/containerd/certs.d"
	for _, tc := range []struct {
		name  string
		rc    containerd.RegistryConfig
		err   error
		state string
		want  []string // in the problem
	}{
		{name: "configured 1.6", rc: containerd.RegistryConfig{Version: "1.6.20", ConfigPath: hosts}, state: api.ConfigPathConfigured},
		{name: "configured 2.x", rc: containerd.RegistryConfig{Version: "v2.4.2", ConfigPath: hosts + "/"}, state: api.ConfigPathConfigured},
		{name: "unset 1.6", rc: containerd.RegistryConfig{Version: "1.6.20"}, state: api.ConfigPathUnset,
			want: []string{"has no registry config_path", "bypass the mirror", table1 + ` config_path = "` + hosts + `"`}},
		{name: "unset with mirrors", rc: containerd.RegistryConfig{Version: "1.7.1", Mirrors: []string{"docker.io", "quay.io"}}, state: api.ConfigPathUnset,
			want: []string{table1, "registry.mirrors of docker.io, quay.io"}},
		{name: "elsewhere", rc: containerd.RegistryConfig{Version: "v2.4.2", ConfigPath: "/etc/cri/conf.d/hosts"}, state: api.ConfigPathMismatch,
			want: []string{`"/etc/cri/conf.d/hosts", not ` + hosts, table2 + ` config_path = "` + hosts + `"`, "--hosts-dir"}},
		{name: "2.x default list", rc: containerd.RegistryConfig{Version: "v2.4.2", ConfigPath: hosts + ":/etc/docker/certs.d"}, state: api.ConfigPathMismatch,
			want: []string{"is a list", "transfer service", table2}},
		{name: "1.x list", rc: containerd.RegistryConfig{Version: "1.6.20", ConfigPath: hosts + ":/etc/docker/certs.d"}, state: api.ConfigPathConfigured},
		{name: "unreachable", err: errors.New("connection refused"), state: api.ConfigPathUnknown,
			want: []string{"cannot ask containerd", "connection refused", table2, table1}},
		{name: "unreported", rc: containerd.RegistryConfig{Version: "v2.1.4"}, err: fmt.Errorf("%w: 2.0 to 2.3", containerd.ErrRegistryConfigUnreported),
			state: api.ConfigPathUnknown, want: []string{"containerd does not say", table2 + ` config_path`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := classifyConfigPath(tc.rc, tc.err, hosts)
			assert.Equal(t, tc.state, r.state)
			assert.Equal(t, tc.rc.Version, r.version)
			if tc.state == api.ConfigPathConfigured {
				assert.Empty(t, r.problem)
			}
			for _, w := range tc.want {
				assert.Contains(t, r.problem, w)
			}
			if tc.err != nil {
				assert.Empty(t, r.configPath)
			}
		})
	}
}

// fakeEvents records the Events a mirrorCheck makes.
type fakeEvents struct{ got []string }

func (f *fakeEvents) event(eventType, reason, message string) bool {
	f.got = append(f.got, eventType+" "+reason+": "+message)
	return true
}

// gaugeStates reads weightd_mirror_containerd_config_path by state.
func gaugeStates(t *testing.T, reg prometheus.Gatherer) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "weightd_mirror_containerd_config_path" {
			continue
		}
		for _, m := range mf.GetMetric() {
			out[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
		}
	}
	return out
}

// onlyState is the gauge's values with state at 1.
func onlyState(state string) map[string]float64 {
	out := map[string]float64{}
	for _, s := range api.ConfigPathStates {
		out[s] = 0
	}
	if state != "" {
		out[state] = 1
	}
	return out
}

// TestMirrorCheckReports runs checks against a containerd whose answers
// the test sets: the gauge and the status follow every answer; the log
// and the node's Events follow changes only (a Warning when containerd
// stops reading the hosts.toml files, a Normal one when it reads them
// again, none for unknown).
func TestMirrorCheckReports(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	events := &fakeEvents{}
	hosts := t.TempDir()
	m := &nodeMirror{cfg: MirrorConfig{MirrorAddr: "127.0.0.1:0", MirrorRegistries: []string{"docker.io"}, HostsDir: hosts}}
	c, err := newMirrorCheck(m, "/run/containerd/containerd.sock", events.event, slog.New(slog.NewTextHandler(&logs, nil)), reg)
	require.NoError(t, err)
	assert.Equal(t, onlyState(""), gaugeStates(t, reg), "all 0 before the first check")
	var st api.MirrorStatus
	c.status(&st)
	assert.Empty(t, st.ConfigPathState)

	var answer containerd.RegistryConfig
	var answerErr error
	c.read = func(_ context.Context, address string) (containerd.RegistryConfig, error) {
		assert.Equal(t, "/run/containerd/containerd.sock", address)
		return answer, answerErr
	}
	step := func(rc containerd.RegistryConfig, err error) {
		t.Helper()
		answer, answerErr = rc, err
		c.report(c.check(t.Context()))
	}

	step(containerd.RegistryConfig{Version: "1.6.20"}, nil)
	assert.Equal(t, onlyState(api.ConfigPathUnset), gaugeStates(t, reg))
	c.status(&st)
	assert.Equal(t, api.ConfigPathUnset, st.ConfigPathState)
	assert.Equal(t, "1.6.20", st.ContainerdVersion)
	assert.Contains(t, st.Problem, table1)
	require.Len(t, events.got, 1)
	assert.True(t, strings.HasPrefix(events.got[0], "Warning MirrorNotConfigured: registry mirror unused: containerd 1.6.20's CRI has no registry config_path"), events.got[0])
	assert.Contains(t, logs.String(), "level=ERROR")
	assert.Contains(t, logs.String(), `io.containerd.grpc.v1.cri`) // quoted by the text handler

	logs.Reset()
	step(containerd.RegistryConfig{Version: "1.6.20"}, nil)
	assert.Len(t, events.got, 1, "no new Event for the same state")
	assert.Empty(t, logs.String(), "no new log line for the same state")

	step(containerd.RegistryConfig{Version: "1.6.20", ConfigPath: hosts}, nil)
	assert.Equal(t, onlyState(api.ConfigPathConfigured), gaugeStates(t, reg))
	c.status(&st)
	assert.Equal(t, api.MirrorStatus{ConfigPathState: api.ConfigPathConfigured, ConfigPath: hosts, ContainerdVersion: "1.6.20"}, st)
	require.Len(t, events.got, 2)
	assert.Equal(t, "Normal MirrorConfigured: containerd reads the registry mirror's hosts.toml files in "+hosts+" again", events.got[1])
	assert.Contains(t, logs.String(), "level=INFO")

	logs.Reset()
	step(containerd.RegistryConfig{}, errors.New("dial unix: connection refused"))
	assert.Equal(t, onlyState(api.ConfigPathUnknown), gaugeStates(t, reg))
	assert.Len(t, events.got, 2, "no Event when containerd cannot be asked")
	assert.Contains(t, logs.String(), "level=WARN")

	step(containerd.RegistryConfig{Version: "v2.4.2", ConfigPath: "/etc/containerd/certs.d:/etc/docker/certs.d"}, nil)
	assert.Equal(t, onlyState(api.ConfigPathMismatch), gaugeStates(t, reg))
	require.Len(t, events.got, 3)
	assert.Contains(t, events.got[2], "Warning MirrorNotConfigured: ")
	assert.Contains(t, events.got[2], table2)

	// The mirror's whole status.
	m.ln = fakeAddrListener{}
	full := m.status(c)
	assert.Equal(t, "127.0.0.1:5001", full.Addr)
	assert.Equal(t, []string{"docker.io"}, full.Registries)
	assert.Equal(t, hosts, full.HostsDir)
	assert.Equal(t, api.ConfigPathMismatch, full.ConfigPathState)
}

// TestMirrorCheckWithout: no hosts directory, no check; no containerd
// address, unknown with the fix for either version.
func TestMirrorCheckWithout(t *testing.T) {
	t.Parallel()
	c, err := newMirrorCheck(&nodeMirror{cfg: MirrorConfig{MirrorAddr: "127.0.0.1:0"}}, "/run/containerd/containerd.sock", nil, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	require.NoError(t, err)
	assert.Nil(t, c)
	c, err = newMirrorCheck(nil, "", nil, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	require.NoError(t, err)
	assert.Nil(t, c)

	c, err = newMirrorCheck(&nodeMirror{cfg: MirrorConfig{HostsDir: "/etc/containerd/certs.d"}}, "", nil, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	require.NoError(t, err)
	r := c.check(t.Context())
	assert.Equal(t, api.ConfigPathUnknown, r.state)
	assert.Contains(t, r.problem, "no --containerd-address")
	assert.Contains(t, r.problem, table1)
	assert.Contains(t, r.problem, table2)
}

// TestMirrorCheckRunStops: Run checks at once and returns when its context
// ends.
func TestMirrorCheckRunStops(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c, err := newMirrorCheck(&nodeMirror{cfg: MirrorConfig{HostsDir: "/etc/containerd/certs.d"}}, "/x.sock", nil, slog.New(slog.DiscardHandler), reg)
	require.NoError(t, err)
	asked := make(chan struct{}, 1)
	c.read = func(context.Context, string) (containerd.RegistryConfig, error) {
		select {
		case asked <- struct{}{}:
		default:
		}
		return containerd.RegistryConfig{Version: "1.6.20", ConfigPath: "/etc/containerd/certs.d"}, nil
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	<-asked
	cancel()
	require.NoError(t, <-done)
}

// TestAgentMirrorConfigPath runs the agent with its mirror and a real
// containerd, 1.6 and 2.x, with the CRI registry config_path set to the
// agent's --hosts-dir and unset: the status and the gauge say configured,
// unset (1.6) or mismatch (2.x, whose default list its pulls do not read);
// with Kubernetes features on, the Node gets a Warning Event. The
// hosts.toml files are written either way, and the kubelet's pull works
// either way: through the mirror when configured, straight from the
// registry otherwise.
func TestAgentMirrorConfigPath(t *testing.T) {
	t.Parallel()
	services.RequireRegistry(t)
	services.RequireContainerd(t)
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	img, err := services.PushRandomImage(t.Context(), reg.Addr, "test/app", "v1", 1, 256<<10, nil)
	require.NoError(t, err)
	for _, tc := range []struct {
		name  string
		v2    bool
		unset bool
		kube  bool
		state string
	}{
		{name: "1.6 set", state: api.ConfigPathConfigured},
		{name: "1.6 unset", unset: true, kube: true, state: api.ConfigPathUnset},
		{name: "2.x set", v2: true, state: api.ConfigPathConfigured},
		{name: "2.x unset", v2: true, unset: true, state: api.ConfigPathMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var bins services.ContainerdBinaries
			if tc.v2 {
				var err error
				bins, err = services.CachedContainerd(services.Containerd2Version)
				if errors.Is(err, services.ErrContainerdNotBuilt) && os.Getenv("CI") != "true" {
					t.Skip(err)
				}
				require.NoError(t, err, "make test-deps builds it")
			}
			ctd := services.NewContainerdT(t, services.ContainerdConfig{Binaries: bins, NoConfigPath: tc.unset})
			var env *kubetest.Env
			const node = "node-1"
			if tc.kube {
				env = kubetest.NewT(t, kubetest.Config{})
				_, err := env.CreateNode(t.Context(), node, nil)
				require.NoError(t, err)
			}
			a, addr := startAgentReturning(t, func(c *Config) {
				c.ContainerdAddress = ctd.Address
				c.MirrorAddr = "127.0.0.1:0"
				c.MirrorRegistries = []string{reg.Addr}
				c.HostsDir = ctd.HostsDir
				if env != nil {
					c.Kubeconfig, c.NodeName = env.Kubeconfig, node
				}
			})
			client, err := api.NewClient(addr)
			require.NoError(t, err)
			var st api.Status
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
				st, err = client.Status(t.Context())
				require.NoError(t, err)
				require.NotNil(t, st.Mirror)
				if st.Mirror.ConfigPathState != "" || time.Now().After(deadline) {
					break
				}
			}
			assert.Equal(t, tc.state, st.Mirror.ConfigPathState, st.Mirror.Problem)
			assert.Equal(t, onlyState(tc.state), gaugeStates(t, a.reg))
			assert.Equal(t, ctd.HostsDir, st.Mirror.HostsDir)
			assert.Equal(t, tc.state == api.ConfigPathConfigured, st.Mirror.Problem == "", st.Mirror.Problem)
			assert.FileExists(t, filepath.Join(ctd.HostsDir, reg.Addr, "hosts.toml"), "written all the same")

			_, err = ctd.PullImageCRI(t.Context(), img.Ref)
			require.NoError(t, err, "the kubelet's pull works whatever the mirror's state")
			served := mirrorRequests(t, a.reg)
			if tc.state == api.ConfigPathConfigured {
				assert.Positive(t, served, "the pull went through the mirror")
			} else {
				assert.Zero(t, served, "the pull bypassed the mirror")
			}

			if env != nil {
				var got []string
				for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
					list, err := env.Clientset().CoreV1().Events("default").List(t.Context(), metav1.ListOptions{
						FieldSelector: fields.Set{"involvedObject.kind": "Node", "involvedObject.name": node}.String(),
					})
					require.NoError(t, err)
					got = got[:0]
					for _, e := range list.Items {
						got = append(got, e.Type+" "+e.Reason+": "+e.Message)
					}
					if len(got) > 0 || time.Now().After(deadline) {
						break
					}
				}
				require.Len(t, got, 1)
				assert.True(t, strings.HasPrefix(got[0], corev1.EventTypeWarning+" "+kube.ReasonMirrorNotConfigured+": registry mirror unused: "), got[0])
				assert.Contains(t, got[0], table1+` config_path = "`+ctd.HostsDir+`"`)
			}
		})
	}
}

// mirrorRequests sums weightd_mirror_requests_total.
func mirrorRequests(t *testing.T, reg prometheus.Gatherer) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == "weightd_mirror_requests_total" {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// fakeAddrListener is a listener that only has an address.
type fakeAddrListener struct{ net.Listener }

func (fakeAddrListener) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 5001} }

// startAgentReturning is startAgentWith returning the agent too.
func startAgentReturning(t *testing.T, edit func(*Config)) (*Agent, string) {
	t.Helper()
	dir := testdisk.ShortDir(t)
	addr := "unix://" + filepath.Join(dir, "api.sock")
	cfg := Config{Root: filepath.Join(dir, "cache"), API: addr, ChunkSize: 1 << 20, MaxJobs: 2, ShutdownTimeout: 5 * time.Second}
	edit(&cfg)
	return runAgent(t, cfg), addr
}
