package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/lora"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/warmpool"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// serveAdapter writes an adapter and its manifest under dir/name, as a
// model served over HTTP, and returns the manifest's path under the
// origin.
func serveAdapter(t *testing.T, dir, name string) string {
	t.Helper()
	sub := filepath.Join(dir, name)
	if err := loratest.WriteAdapter(sub, loratest.AdapterSpec{}); err != nil {
		t.Fatal(err)
	}
	m := httpsource.Manifest{Name: "test/" + name, Revision: "main"}
	for _, f := range []string{lora.ConfigFile, lora.WeightsFile} {
		b, err := os.ReadFile(filepath.Join(sub, f))
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b)
		m.Files = append(m.Files, httpsource.ManifestFile{Path: f, Size: int64(len(b)), SHA256: hex.EncodeToString(sum[:])})
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sub, "model.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return "/" + name + "/model.json"
}

// The agent's warm pool over its real prefetch queue and cache: an adapter
// fetched from an origin is staged from the cache and loaded into a runtime
// test server, which opens the files; the server's base is fetched, pinned
// and kept in the DRAM tier for it, and unpinned and released when the
// server goes.
func TestWarmPoolOnQueue(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if _, err := genmodel.Generate(filepath.Join(dir, "base"), genmodel.Spec{Name: "test/base", Files: 2, TotalBytes: 1 << 20, Seed: 3}); err != nil {
		t.Fatal(err)
	}
	adapterPath := serveAdapter(t, dir, "sql")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	orig := genmodel.NewServer(ln, dir)
	baseRef := orig.URL() + "/base/" + genmodel.ManifestName
	adapterRef := orig.URL() + adapterPath

	root := t.TempDir()
	store, err := cache.Open(filepath.Join(root, "cache"), cache.WithChunkSize(1<<20))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	cfg := WarmConfig{Warm: true, WarmHealthInterval: 20 * time.Millisecond, WarmDRAMBudget: 4 << 20}
	dram, err := newDRAMTier(cfg, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	pool, err := newWarmPool(cfg, root, queue, store, dram, nil, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	srv, err := loratest.NewVLLM(loratest.Options{Slots: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	ctx, cancel := context.WithCancel(t.Context())
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return orig.Run(gctx) })
	g.Go(func() error { return queue.Run(gctx) })
	g.Go(func() error { return pool.Run(gctx) })
	defer func() {
		cancel()
		if err := g.Wait(); err != nil {
			t.Error(err)
		}
	}()

	spec := warmpool.ServerSpec{Pod: "ai/warm-0", UID: "u0", Base: baseRef, Runtime: engine.VLLM, Endpoint: srv.URL(), Slots: 2}
	pool.SetServers([]warmpool.ServerSpec{spec})
	owner := warmpool.PinPrefix + spec.Pod
	pinned := func() int {
		n := 0
		for _, info := range store.List() {
			if slices.Contains(info.Pins, owner) {
				n++
			}
		}
		return n
	}
	waitUntil(t, pool, func() bool {
		s := pool.Servers()
		return len(s) == 1 && s[0].Healthy && pinned() == 2 && dram.Status().Kept > 0
	})
	// The tier holds the base's files: 1 MiB in 2.
	if st := dram.Status(); st.Kept != 1<<20 || len(st.Files) != 2 {
		t.Fatalf("DRAM tier keeps %d bytes in %d files, want the base's %d in 2", st.Kept, len(st.Files), 1<<20)
	}

	ans, err := pool.Ensure(t.Context(), api.AdapterRequest{Base: baseRef, Ref: adapterRef, Name: "sql"})
	if err != nil {
		t.Fatal(err)
	}
	if !ans.Loaded || ans.Model != "sql" || ans.Endpoint != srv.URL() {
		t.Fatalf("answer %+v", ans)
	}
	// Staged under the stage directory by name and content (sql.<digest>).
	if got := srv.Loaded()["sql"]; filepath.Dir(got) != filepath.Join(root, "adapters") || !strings.HasPrefix(filepath.Base(got), "sql.") {
		t.Fatalf("server loaded sql from %q", got)
	}
	// A bad reference is the caller's fault.
	if _, err := pool.Ensure(t.Context(), api.AdapterRequest{Base: baseRef, Ref: "ftp://nope"}); !errors.Is(err, api.ErrBadRequest) {
		t.Fatalf("bad reference: %v", err)
	}

	pool.SetServers(nil)
	if n := pinned(); n != 0 {
		t.Fatalf("%d blobs still pinned for a server gone", n)
	}
	if st := dram.Status(); st.Kept != 0 {
		t.Fatalf("DRAM tier still keeps %d bytes for a server gone", st.Kept)
	}
}

// waitUntil waits on the pool's change notifications (and a short tick,
// for changes outside it) until ok; it fails after a generous bound.
func waitUntil(t *testing.T, pool *warmpool.Pool, ok func() bool) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !ok() {
		select {
		case <-pool.Changed():
		case <-tick.C:
		case <-deadline:
			t.Fatalf("never got there: %+v", pool.Servers())
		}
	}
}

func TestWarmPoolOff(t *testing.T) {
	t.Parallel()
	pool, err := newWarmPool(WarmConfig{}, t.TempDir(), nil, nil, nil, nil, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if pool != nil || err != nil {
		t.Fatalf("pool %v, err %v with --warm off", pool, err)
	}
	if _, err := newWarmPool(WarmConfig{Warm: true, WarmHealthInterval: -time.Second}, t.TempDir(), nil, nil, nil, nil, slog.New(slog.DiscardHandler), nil); err == nil {
		t.Fatal("negative interval accepted")
	}
	if _, err := newWarmPool(WarmConfig{Warm: true, WarmEviction: "fifo"}, t.TempDir(), nil, nil, nil, nil, slog.New(slog.DiscardHandler), nil); err == nil {
		t.Fatal("eviction fifo accepted")
	}
}

// The bases of warm servers are pinned within --warm-pin-budget-percent of
// the cache budget: with room for one base in the share, the second
// server's base is fetched but not pinned, until the first server goes.
func TestWarmPinBudget(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for i, name := range []string{"base-a", "base-b"} {
		if _, err := genmodel.Generate(filepath.Join(dir, name), genmodel.Spec{Name: "test/" + name, Files: 2, TotalBytes: 1 << 20, Seed: uint64(i)}); err != nil {
			t.Fatal(err)
		}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	orig := genmodel.NewServer(ln, dir)
	root := t.TempDir()
	// 3 MiB of budget, half of it for warm pins: one base of 1 MiB fits,
	// two do not.
	store, err := cache.Open(filepath.Join(root, "cache"), cache.WithChunkSize(1<<20), cache.WithBudget(3<<20, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	queue := prefetch.NewQueue(store, source.Sources{ref.KindHTTP: httpsource.New(http.DefaultClient)})
	cfg := WarmConfig{Warm: true, WarmHealthInterval: 20 * time.Millisecond, WarmPinBudgetPercent: 50}
	pool, err := newWarmPool(cfg, root, queue, store, nil, nil, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return orig.Run(gctx) })
	g.Go(func() error { return queue.Run(gctx) })
	g.Go(func() error { return pool.Run(gctx) })
	defer func() {
		cancel()
		if err := g.Wait(); err != nil {
			t.Error(err)
		}
	}()

	var specs []warmpool.ServerSpec
	for _, name := range []string{"base-a", "base-b"} {
		srv, err := loratest.NewVLLM(loratest.Options{Slots: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		specs = append(specs, warmpool.ServerSpec{Pod: "ai/" + name, UID: name, Base: orig.URL() + "/" + name + "/" + genmodel.ManifestName,
			Runtime: engine.VLLM, Endpoint: srv.URL(), Slots: 1})
	}
	pinned := func(pod string) int {
		n := 0
		for _, info := range store.List() {
			if slices.Contains(info.Pins, warmpool.PinPrefix+pod) {
				n++
			}
		}
		return n
	}
	pool.SetServers(specs)
	var first, second string
	waitUntil(t, pool, func() bool {
		a, b := pinned("ai/base-a"), pinned("ai/base-b")
		switch {
		case a == 2 && b == 0:
			first, second = "ai/base-a", "ai/base-b"
		case b == 2 && a == 0:
			first, second = "ai/base-b", "ai/base-a"
		}
		return first != "" && len(store.List()) == 4 // both bases fetched
	})
	// Several more checks retry the second Keep: still over the share.
	for range 5 {
		<-pool.Changed()
		if n := pinned(second); n != 0 {
			t.Fatalf("%d blobs of %s's base pinned over the share", n, second)
		}
	}
	var rest []warmpool.ServerSpec
	for _, s := range specs {
		if s.Pod == second {
			rest = append(rest, s)
		}
	}
	pool.SetServers(rest)
	waitUntil(t, pool, func() bool { return pinned(first) == 0 && pinned(second) == 2 })
}
