package agent

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/internal/s3test"
	"github.com/weightd/weightd/internal/services"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/prefetch"
)

// fetchWait fetches ref through the agent's API and waits for the end.
func fetchWait(t *testing.T, addr, ref string) prefetch.JobStatus {
	t.Helper()
	client, err := api.NewClient(addr)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	st, err := client.Submit(ctx, api.FetchRequest{Ref: ref, Priority: "pod"})
	require.NoError(t, err)
	st, err = client.Watch(ctx, st.ID, nil)
	require.NoError(t, err)
	return st
}

// TestAgentImagesAndMirror is the image path end to end against a real
// registry and a real containerd: the agent prefetches an image into
// containerd, then, with the registry stopped, containerd pulls it again
// through the agent's mirror.
func TestAgentImagesAndMirror(t *testing.T) {
	t.Parallel()
	services.RequireRegistry(t)
	services.RequireContainerd(t)
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	ctrd := services.NewContainerdT(t, services.ContainerdConfig{})
	img, err := services.PushRandomImage(t.Context(), reg.Addr, "test/app", "v1", 3, 1<<20, nil)
	require.NoError(t, err)

	addr := startAgentWith(t, func(c *Config) {
		c.ContainerdAddress = ctrd.Address
		c.MirrorAddr = "127.0.0.1:0"
		c.MirrorRegistries = []string{reg.Addr}
		c.HostsDir = ctrd.HostsDir
	})
	st := fetchWait(t, addr, "oci://"+img.Ref)
	require.Equal(t, prefetch.StateReady, st.State, st.Error)
	assert.Equal(t, prefetch.PriorityPod, st.Priority)
	out, err := ctrd.Ctr(t.Context(), "images", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, string(out), img.Ref, "containerd lists the imported image")
	out, err = ctrd.Ctr(t.Context(), "snapshots", "ls")
	require.NoError(t, err)
	assert.GreaterOrEqual(t, strings.Count(string(out), "Committed"), 3, "the layers are unpacked:\n%s", out)
	hosts, err := os.ReadFile(filepath.Join(ctrd.HostsDir, reg.Addr, "hosts.toml"))
	require.NoError(t, err)
	assert.Contains(t, string(hosts), "server = 'http://"+reg.Addr+"'")

	// The kubelet's own pull, with the registry down: served by the mirror.
	_, err = ctrd.Ctr(t.Context(), "images", "rm", "--sync", img.Ref)
	require.NoError(t, err)
	reg.Stop()
	before := reg.BytesServed()
	out, err = ctrd.Ctr(t.Context(), "images", "pull", "--hosts-dir", ctrd.HostsDir, img.Ref)
	require.NoError(t, err, "%s", out)
	assert.Equal(t, before, reg.BytesServed(), "nothing came from the registry")
}

// TestAgentHubModel fetches a model from a Hugging Face style hub by branch.
func TestAgentHubModel(t *testing.T) {
	t.Parallel()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	repo := hub.AddRepo("org/tiny", map[string]hubtest.Content{
		"config.json":       hubtest.String(`{"model_type":"llama"}`),
		"model.safetensors": hubtest.Generated(3<<20+5, 1),
	})
	addr := startAgentWith(t, func(c *Config) { c.HFEndpoint = hub.URL })
	st := fetchWait(t, addr, "hf://org/tiny@main")
	require.Equal(t, prefetch.StateReady, st.State, st.Error)
	assert.Equal(t, repo.Resolve("main"), st.Revision, "the model is materialised at the commit")
	got, err := os.ReadFile(filepath.Join(st.Dir, "config.json"))
	require.NoError(t, err)
	assert.JSONEq(t, `{"model_type":"llama"}`, string(got))
	info, err := os.Stat(filepath.Join(st.Dir, "model.safetensors"))
	require.NoError(t, err)
	assert.Equal(t, int64(3<<20+5), info.Size())
}

// TestAgentS3Model fetches a model from an S3-compatible server (gofakes3
// on loopback) with the flags an operator sets for a self-hosted store; the
// agent's credentials come from the environment through the SDK's default
// chain, and the endpoint, being the operator's, is reachable on loopback
// without --fetch-allow-cidrs.
func TestAgentS3Model(t *testing.T) {
	t.Setenv("AWS_ACCESS_KEY_ID", "agent")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "secret")
	t.Setenv("AWS_CONFIG_FILE", filepath.Join(t.TempDir(), "none"))
	t.Setenv("AWS_SHARED_CREDENTIALS_FILE", filepath.Join(t.TempDir(), "none"))
	srv, err := s3test.Start()
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	require.NoError(t, srv.CreateBucket(t.Context(), "models", false))
	files := map[string]string{"config.json": `{"model_type":"llama"}`, "weights/model.safetensors": strings.Repeat("w", 3<<20+5)}
	for p, data := range files {
		_, err := srv.Put(t.Context(), "models", "tiny/"+p, []byte(data))
		require.NoError(t, err)
		srv.SetChecksum("models", "tiny/"+p, s3test.FullObject([]byte(data)))
	}
	srv.ResetRequests()

	addr := startAgentWith(t, func(c *Config) {
		c.FetchAllowCIDRs = nil
		c.S3Endpoint, c.S3PathStyle, c.S3Region = srv.URL, true, "eu-central-1"
	})
	st := fetchWait(t, addr, "s3://models/tiny")
	require.Equal(t, prefetch.StateReady, st.State, st.Error)
	for p, data := range files {
		got, err := os.ReadFile(filepath.Join(st.Dir, p))
		require.NoError(t, err)
		assert.Equal(t, data, string(got), p)
	}
	reqs := srv.Requests()
	require.NotEmpty(t, reqs)
	for _, r := range reqs {
		assert.True(t, r.Signed, "the operator's fetch carries the agent's credentials: %s %s", r.Method, r.Path)
	}
}

func TestSplitImageName(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, registry, repo, tag string
		ok                        bool
	}{
		{"ghcr.io/org/app:v1", "ghcr.io", "org/app", "v1", true},
		{"127.0.0.1:5000/a/b/c:latest", "127.0.0.1:5000", "a/b/c", "latest", true},
		{"ghcr.io/org/app@sha256:abc", "", "", "", false},
		{"ghcr.io/org/app", "", "", "", false},
		{"app:v1", "", "", "", false},
	} {
		registry, repo, tag, ok := splitImageName(tt.name)
		assert.Equal(t, tt.ok, ok, tt.name)
		assert.Equal(t, []string{tt.registry, tt.repo, tt.tag}, []string{registry, repo, tag}, tt.name)
	}
}
