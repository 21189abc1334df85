package warmpool

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

const testBase = "hf://org/base@main"

// dirFetcher serves "test://NAME" from root/NAME, as the cache would
// after a fetch.
type dirFetcher struct {
	root  string
	calls atomic.Int32

	mu         sync.Mutex
	requesters []string // source.Requester of each fetch
}

func (f *dirFetcher) Fetch(ctx context.Context, ref string) (string, error) {
	f.calls.Add(1)
	f.mu.Lock()
	f.requesters = append(f.requesters, source.Requester(ctx))
	f.mu.Unlock()
	name, ok := strings.CutPrefix(ref, "test://")
	if !ok {
		return "", fmt.Errorf("%w: reference %q: not test://", api.ErrBadRequest, ref)
	}
	dir := filepath.Join(f.root, name)
	if _, err := os.Stat(dir); err != nil {
		return "", err
	}
	return dir, nil
}

// recBases records what the pool keeps and drops.
type recBases struct {
	mu      sync.Mutex
	kept    []string
	dropped []string
}

func (b *recBases) Keep(_ context.Context, s ServerSpec) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.kept = append(b.kept, s.Pod)
	return nil
}

func (b *recBases) Drop(s ServerSpec) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.dropped = append(b.dropped, s.Pod)
}

func (b *recBases) snapshot() (kept, dropped []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.kept...), append([]string(nil), b.dropped...)
}

// countingDriver counts the load requests a server is sent, answered or
// not.
type countingDriver struct {
	engine.Driver
	loads *atomic.Int32
}

func (d countingDriver) Load(ctx context.Context, name, path string, pinned bool) error {
	d.loads.Add(1)
	return d.Driver.Load(ctx, name, path, pinned)
}

// fixture is a pool over real runtime test servers (loopback HTTP) and the
// real drivers.
type fixture struct {
	t       *testing.T
	pool    *Pool
	cfg     Config
	fetch   *dirFetcher
	bases   *recBases
	reg     *prometheus.Registry
	servers []*loratest.Server
	specs   []ServerSpec
	// loadCalls counts load requests sent to any server.
	loadCalls atomic.Int32
}

type serverOpts struct {
	kind    engine.Kind
	slots   int
	maxRank int
	// older: an SGLang release that lists no adapter in /v1/models.
	older bool
	// perBatch is SGLang's --max-loras-per-batch (the double's default
	// when zero).
	perBatch int
}

func newFixture(t *testing.T, servers ...serverOpts) *fixture {
	t.Helper()
	f := &fixture{t: t, fetch: &dirFetcher{root: t.TempDir()}, bases: &recBases{}, reg: prometheus.NewRegistry()}
	for i, o := range servers {
		lo := loratest.Options{Base: "base", MaxRank: o.maxRank, Slots: o.slots, OlderSGLang: o.older, MaxLorasPerBatch: o.perBatch}
		var srv *loratest.Server
		var err error
		if o.kind == engine.SGLang {
			srv, err = loratest.NewSGLang(lo)
		} else {
			o.kind = engine.VLLM
			srv, err = loratest.NewVLLM(lo)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Close)
		f.servers = append(f.servers, srv)
		f.specs = append(f.specs, ServerSpec{
			Pod: fmt.Sprintf("ai/warm-%d", i), UID: fmt.Sprintf("uid-%d", i), Base: testBase, Runtime: o.kind,
			Endpoint: srv.URL(), Slots: o.slots, MaxRank: o.maxRank,
		})
	}
	client := &http.Client{}
	t.Cleanup(client.CloseIdleConnections)
	f.cfg = Config{
		StageDir: t.TempDir(), Fetcher: f.fetch, Bases: f.bases, Registerer: f.reg,
		CallTimeout: 5 * time.Second, LoadTimeout: 5 * time.Second,
		Drivers: func(kind engine.Kind, endpoint string) (engine.Driver, error) {
			d, err := engine.New(kind, endpoint, client)
			if err != nil {
				return nil, err
			}
			return countingDriver{Driver: d, loads: &f.loadCalls}, nil
		},
	}
	f.pool = f.newPool()
	return f
}

// newPool builds a pool on the fixture's configuration and servers and
// checks them once, as Run does first.
func (f *fixture) newPool() *Pool {
	f.t.Helper()
	cfg := f.cfg
	cfg.Registerer = prometheus.NewRegistry()
	if f.pool == nil {
		cfg.Registerer = f.reg
	}
	p, err := New(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	p.SetServers(f.specs)
	p.checkAll(f.t.Context())
	return p
}

// adapter writes an adapter the fetcher serves and returns its reference.
func (f *fixture) adapter(name string, spec loratest.AdapterSpec) string {
	f.t.Helper()
	if err := loratest.WriteAdapter(filepath.Join(f.fetch.root, name), spec); err != nil {
		f.t.Fatal(err)
	}
	return "test://" + name
}

func (f *fixture) ensure(owner, ref, name string) (api.AdapterAnswer, error) {
	return f.pool.EnsureFor(f.t.Context(), owner, api.AdapterRequest{Base: testBase, Ref: ref, Name: name})
}

func (f *fixture) mustEnsure(owner, ref, name string) api.AdapterAnswer {
	f.t.Helper()
	ans, err := f.ensure(owner, ref, name)
	if err != nil {
		f.t.Fatalf("ensuring %s: %v", ref, err)
	}
	return ans
}

// loaded lists the adapters the pool says server i holds.
func (f *fixture) loaded(i int) []string {
	var names []string
	for _, s := range f.pool.Servers() {
		if s.Pod == f.specs[i].Pod {
			for _, a := range s.Adapters {
				names = append(names, a.Name)
			}
		}
	}
	return names
}
