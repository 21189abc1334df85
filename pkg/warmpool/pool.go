package warmpool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/lora"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// Fetcher brings an adapter into the local cache. QueueFetcher implements
// it with the agent's prefetch queue (cache and swarm).
type Fetcher interface {
	// Fetch fetches the adapter at ref and returns the directory holding
	// its files (adapter_config.json, the safetensors weights). ctx names
	// the pod's namespace the fetch is for (source.Requester), which
	// decides whether the agent's credentials go on it. An unparsable
	// reference is an error wrapping api.ErrBadRequest.
	Fetch(ctx context.Context, ref string) (dir string, err error)
}

// Bases keeps the base models of warm servers in the cache. NewBasePinner
// implements it with the agent's prefetch queue and pins in the cache.
type Bases interface {
	// Keep fetches the base model of s and pins its blobs on behalf of s.
	// It may take long (a base is large); the pool calls it from Run and
	// calls it again after a failure.
	Keep(ctx context.Context, s ServerSpec) error
	// Drop releases what Keep pinned for s; it must not block.
	Drop(s ServerSpec)
}

// DriverFunc builds the runtime driver of a server.
type DriverFunc func(kind engine.Kind, endpoint string) (engine.Driver, error)

// Config configures a Pool. StageDir, Fetcher and Bases are required; zero
// values of the rest take the defaults of DefaultConfig.
type Config struct {
	// StageDir is the host directory where adapters are staged, one
	// directory per adapter name; warm servers mount it (a hostPath).
	StageDir string
	// ServerStageDir is StageDir as the servers see it, the directory the
	// load requests name (default: StageDir).
	ServerStageDir string
	Fetcher        Fetcher
	Bases          Bases
	// Drivers builds each server's runtime driver (default: engine.New with
	// an HTTP client of its own).
	Drivers DriverFunc
	// GPUUse reports which GPUs a server's pod (by UID) uses and how many
	// bytes of GPU memory its processes hold; nil when the node has no GPU
	// inventory.
	GPUUse func(podUID string) (gpuUUIDs []string, bytes uint64)
	// HealthInterval is how often each server's health and adapter list are
	// checked (default 10s).
	HealthInterval time.Duration
	// CallTimeout bounds a health check, a listing or an unload (default 5s).
	CallTimeout time.Duration
	// LoadTimeout bounds one adapter load by a runtime (default 60s).
	LoadTimeout time.Duration
	// Logger receives the pool's log lines (default: discarded).
	Logger *slog.Logger
	// Registerer receives the pool's metrics (default: none registered).
	Registerer prometheus.Registerer
	// Eviction chooses the adapter unloaded when a load finds every slot
	// taken: EvictLFU (default), or EvictLRU. Neither evicts an adapter
	// pinned, in use or loading.
	Eviction string
}

// DefaultConfig returns the defaults of the optional fields.
func DefaultConfig() Config {
	return Config{HealthInterval: 10 * time.Second, CallTimeout: 5 * time.Second, LoadTimeout: 60 * time.Second, Eviction: EvictLFU}
}

// maxAttempts bounds how often an ensure starts over after waiting for a
// concurrent one of the same adapter.
const maxAttempts = 4

// Pool is the warm pool of one node: its warm servers and the adapters
// loaded in them. Its methods are safe for concurrent use.
type Pool struct {
	cfg     Config
	log     *slog.Logger
	m       *metrics
	wake    chan struct{} // asks Run for a check now
	changed chan struct{}
	// stageMu orders staging and removing of staged directories.
	stageMu sync.Mutex

	mu      sync.Mutex
	servers map[string]*server  // by pod namespace/name
	flights map[string]*flight  // by flightKey(base, name)
	history map[string]*history // by base, of the bases with servers
	seq     uint64              // counts state changes; orders a listing against loads
}

// server is one warm server and the adapters the pool knows it holds.
type server struct {
	spec ServerSpec
	drv  engine.Driver
	// synced: listed at least once; the pool places no adapter before.
	synced  bool
	healthy bool
	err     string
	kept    bool // Bases.Keep succeeded
	keeping bool // Bases.Keep running
	gpus    []string
	gpuMem  uint64
	// adapters holds loaded and loading adapters: each one takes a slot.
	adapters map[string]*adapter
	// unloading are names evicted, with 0 while the unload runs and then
	// p.seq when it ended: a listing that began before the end and still
	// shows them does not adopt them again.
	unloading map[string]uint64
}

type adapter struct {
	name string
	ref  string // "" when found loaded after a restart of the agent
	// stage is its directory under StageDir (stageName); "" when it was
	// found loaded from elsewhere.
	stage    string
	loading  bool
	seq      uint64 // p.seq when it was loaded
	lastUsed time.Time
	pinned   bool
	// runtimePinned: loaded with the runtime's pin, which SGLang grants
	// to fewer adapters than pinned may hold (see runtimePinLocked).
	runtimePinned bool
	users         map[string]struct{}
}

func (a *adapter) evictable() bool { return !a.loading && !a.pinned && len(a.users) == 0 }

// flight is a load in progress that ensures of the same adapter wait for.
type flight struct {
	done chan struct{}
	err  error
}

func flightKey(base, name string) string { return base + "\x00" + name }

// New builds a pool. It creates StageDir and removes what a crash left
// half-staged there; it starts no goroutines (Run does).
func New(cfg Config) (*Pool, error) {
	def := DefaultConfig()
	if cfg.StageDir == "" || cfg.Fetcher == nil || cfg.Bases == nil {
		return nil, errors.New("warmpool: StageDir, Fetcher and Bases are required")
	}
	if cfg.ServerStageDir == "" {
		cfg.ServerStageDir = cfg.StageDir
	}
	if cfg.HealthInterval < 0 || cfg.CallTimeout < 0 || cfg.LoadTimeout < 0 {
		return nil, errors.New("warmpool: negative interval or timeout")
	}
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = def.HealthInterval
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = def.CallTimeout
	}
	if cfg.LoadTimeout == 0 {
		cfg.LoadTimeout = def.LoadTimeout
	}
	switch cfg.Eviction {
	case "":
		cfg.Eviction = def.Eviction
	case EvictLFU, EvictLRU:
	default:
		return nil, fmt.Errorf("warmpool: eviction %q: want %q or %q", cfg.Eviction, EvictLFU, EvictLRU)
	}
	if cfg.Drivers == nil {
		client := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
		cfg.Drivers = func(kind engine.Kind, endpoint string) (engine.Driver, error) {
			return engine.New(kind, endpoint, client)
		}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.StageDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating the adapter stage directory: %w", err)
	}
	if err := cleanStage(cfg.StageDir); err != nil {
		return nil, fmt.Errorf("cleaning the adapter stage directory: %w", err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("registering warm pool metrics: %w", err)
	}
	p := &Pool{
		cfg: cfg, log: log, m: m,
		wake:    make(chan struct{}, 1),
		changed: make(chan struct{}, 1),
		servers: make(map[string]*server),
		flights: make(map[string]*flight),
		history: make(map[string]*history),
	}
	p.updateGaugesLocked()
	return p, nil
}

// Changed returns a channel that receives a value after the servers or
// their adapters changed; changes that come while nobody reads are
// coalesced into one. A publisher reads it, then Servers.
func (p *Pool) Changed() <-chan struct{} { return p.changed }

// notifyLocked signals a change to Changed's reader and updates the gauges.
func (p *Pool) notifyLocked() {
	p.updateGaugesLocked()
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

func (p *Pool) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// Ensure makes the adapter req.Ref available under req.Name (derived from
// the reference when empty) on a warm server of req.Base, and says where. It
// implements api.Adapters.
func (p *Pool) Ensure(ctx context.Context, req api.AdapterRequest) (api.AdapterAnswer, error) {
	return p.EnsureFor(ctx, "", req)
}

// EnsureFor is Ensure on behalf of owner (a pod's UID, say): the adapter is
// in use, never evicted, until Release(owner). An empty owner marks no use.
// With req.Namespace set, only servers that serve that namespace
// (ServerSpec.Shared, or of that namespace) are used or named.
//
// Errors wrap api.ErrNotFound when no warm server serves the base,
// api.ErrBadRequest for an invalid request or adapter (bad name or
// reference, missing or corrupt files, rank over the servers' maximum, a
// name already given to another reference, refused by the runtime) and
// api.ErrBusy when every slot of the base's servers holds an adapter that
// cannot be evicted or no server is healthy.
func (p *Pool) EnsureFor(ctx context.Context, owner string, req api.AdapterRequest) (api.AdapterAnswer, error) {
	start := time.Now()
	if req.Base == "" || req.Ref == "" {
		return api.AdapterAnswer{}, fmt.Errorf("%w: base and ref are required", api.ErrBadRequest)
	}
	name := req.Name
	if name == "" {
		name = AdapterName(req.Ref)
	}
	if !engine.ValidAdapterName(name) {
		return api.AdapterAnswer{}, fmt.Errorf("%w: adapter name %q: want 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit", api.ErrBadRequest, name)
	}
	key := flightKey(req.Base, name)
	for attempt := 1; ; attempt++ {
		p.mu.Lock()
		ans, hit, err := p.hitLocked(owner, req, name)
		if hit || err != nil {
			p.mu.Unlock()
			ans.Seconds = time.Since(start).Seconds()
			return ans, err
		}
		if f := p.flights[key]; f != nil {
			p.mu.Unlock()
			select {
			case <-f.done:
			case <-ctx.Done():
				return api.AdapterAnswer{}, fmt.Errorf("waiting for adapter %s to load: %w", name, ctx.Err())
			}
			// A leader whose own caller gave up is no reason to fail.
			if f.err != nil && !errors.Is(f.err, context.Canceled) && !errors.Is(f.err, context.DeadlineExceeded) {
				return api.AdapterAnswer{}, f.err
			}
			if attempt == maxAttempts {
				return api.AdapterAnswer{}, fmt.Errorf("%w: adapter %s was unloaded again before it could be used", api.ErrBusy, name)
			}
			continue
		}
		if err := p.baseServedLocked(req.Base, req.Namespace); err != nil {
			p.mu.Unlock()
			return api.AdapterAnswer{}, err
		}
		f := &flight{done: make(chan struct{})}
		p.flights[key] = f
		p.mu.Unlock()

		ans, err = p.load(ctx, owner, req, name, start)

		p.mu.Lock()
		delete(p.flights, key)
		f.err = err
		close(f.done)
		p.mu.Unlock()
		ans.Seconds = time.Since(start).Seconds()
		return ans, err
	}
}

// hitLocked answers from an adapter already loaded on a healthy server of
// the base, marking it used.
func (p *Pool) hitLocked(owner string, req api.AdapterRequest, name string) (api.AdapterAnswer, bool, error) {
	for _, s := range p.sortedLocked() {
		if s.spec.Base != req.Base || !s.healthy || !s.synced || !s.spec.serves(req.Namespace) {
			continue
		}
		a := s.adapters[name]
		if a == nil || a.loading || a.ref == "" {
			// One found loaded after a restart is used once load has
			// compared its files with those of req.Ref.
			continue
		}
		if a.ref != req.Ref {
			// The other reference may be another tenant's: not named.
			return api.AdapterAnswer{}, false, fmt.Errorf("%w: adapter name %s already serves another adapter on %s: choose another name", api.ErrBadRequest, name, s.spec.Pod)
		}
		a.ref = req.Ref
		p.useLocked(req.Base, a, owner, req.Pin)
		p.notifyLocked()
		return api.AdapterAnswer{Server: s.spec.Pod, Endpoint: s.spec.Endpoint, Model: name}, true, nil
	}
	return api.AdapterAnswer{}, false, nil
}

// baseServedLocked fails with api.ErrNotFound when no server of base serves
// namespace.
func (p *Pool) baseServedLocked(base, namespace string) error {
	for _, s := range p.servers {
		if s.spec.Base == base && s.spec.serves(namespace) {
			return nil
		}
	}
	if namespace != "" {
		return fmt.Errorf("%w: no warm server of base %s on this node serves namespace %s", api.ErrNotFound, base, namespace)
	}
	return fmt.Errorf("%w: no warm server of base %s on this node", api.ErrNotFound, base)
}

// load fetches, checks and stages the adapter, reserves a slot (evicting
// an adapter if it must), loads it and verifies that
// the server lists it. The caller holds the adapter's flight.
func (p *Pool) load(ctx context.Context, owner string, req api.AdapterRequest, name string, start time.Time) (api.AdapterAnswer, error) {
	dir, err := p.cfg.Fetcher.Fetch(source.WithRequester(ctx, req.Namespace), req.Ref)
	if err != nil {
		return api.AdapterAnswer{}, fmt.Errorf("fetching adapter %s: %w", req.Ref, err)
	}
	info, err := lora.Inspect(dir)
	if err != nil {
		return api.AdapterAnswer{}, fmt.Errorf("%w: checking adapter %s: %w", api.ErrBadRequest, req.Ref, err)
	}
	digest, err := contentDigest(dir)
	if err != nil {
		return api.AdapterAnswer{}, fmt.Errorf("fetching adapter %s: %w", req.Ref, err)
	}
	stage := stageName(name, digest)

	p.mu.Lock()
	for _, s := range p.servers {
		if a := s.adapters[name]; a != nil && a.ref != "" && a.ref != req.Ref {
			p.mu.Unlock()
			return api.AdapterAnswer{}, fmt.Errorf("%w: adapter name %s already serves another adapter on this node: choose another name", api.ErrBadRequest, name)
		}
	}
	if s, a := p.adoptedLocked(req.Base, req.Namespace, name); a != nil && a.stage == stage {
		// Found loaded after a restart, with these very files: take it over.
		a.ref = req.Ref
		p.useLocked(req.Base, a, owner, req.Pin)
		p.notifyLocked()
		p.mu.Unlock()
		return api.AdapterAnswer{Server: s.spec.Pod, Endpoint: s.spec.Endpoint, Model: name}, nil
	}
	s, victim, err := p.reserveLocked(req.Base, req.Namespace, name, info.Rank)
	if err != nil {
		p.mu.Unlock()
		return api.AdapterAnswer{}, err
	}
	a := &adapter{name: name, ref: req.Ref, stage: stage, loading: true}
	a.runtimePinned = req.Pin && runtimePinLocked(s)
	if victim != nil {
		delete(s.adapters, victim.name)
		s.unloading[victim.name] = 0
	}
	s.adapters[name] = a
	p.updateGaugesLocked()
	p.mu.Unlock()
	runtime := string(s.spec.Runtime)

	if victim != nil {
		if err := p.evict(ctx, s, victim); err != nil {
			p.mu.Lock()
			delete(s.adapters, name)
			// It is still loaded as far as anyone knows.
			s.adapters[victim.name] = victim
			p.notifyLocked()
			p.mu.Unlock()
			return api.AdapterAnswer{}, err
		}
	}
	if err := p.stageOnce(stage, dir); err != nil {
		p.m.loads.WithLabelValues(runtime, outcomeError).Inc()
		p.abandon(s, a)
		return api.AdapterAnswer{}, err
	}
	if outcome, err := p.loadInto(ctx, s, name, stage, a.runtimePinned); err != nil {
		p.m.loads.WithLabelValues(runtime, outcome).Inc()
		p.abandon(s, a)
		return api.AdapterAnswer{}, err
	}
	p.m.loads.WithLabelValues(runtime, outcomeOK).Inc()
	p.m.swap.WithLabelValues(runtime).Observe(time.Since(start).Seconds())

	p.mu.Lock()
	defer p.mu.Unlock()
	if s.adapters[name] != a {
		// The server was removed or its adapters lost while we loaded.
		return api.AdapterAnswer{}, fmt.Errorf("%w: warm server %s changed while loading adapter %s", api.ErrBusy, s.spec.Pod, name)
	}
	p.seq++
	a.loading, a.seq = false, p.seq
	p.useLocked(req.Base, a, owner, req.Pin)
	p.notifyLocked()
	p.log.Info("adapter loaded", "adapter", name, "ref", req.Ref, "server", s.spec.Pod, "evicted", victimName(victim), "seconds", time.Since(start).Seconds())
	return api.AdapterAnswer{Server: s.spec.Pod, Endpoint: s.spec.Endpoint, Model: name, Loaded: true}, nil
}

// loadInto asks s to load the adapter staged in StageDir/stage under name
// and checks that it lists it; on failure it returns the outcome for the
// loads metric.
func (p *Pool) loadInto(ctx context.Context, s *server, name, stage string, pin bool) (string, error) {
	lctx, cancel := context.WithTimeout(ctx, p.cfg.LoadTimeout)
	defer cancel()
	err := s.drv.Load(lctx, name, filepath.Join(p.cfg.ServerStageDir, stage), pin)
	if errors.Is(err, engine.ErrAlreadyLoaded) {
		err = nil
	}
	switch {
	case errors.Is(err, engine.ErrRejected):
		return outcomeRejected, fmt.Errorf("%w: loading adapter %s into %s: %w", api.ErrBadRequest, name, s.spec.Pod, err)
	case err != nil:
		// It may have loaded after all, or the server died: a check lists it.
		p.kick()
		return outcomeUnavailable, fmt.Errorf("loading adapter %s into %s: %w", name, s.spec.Pod, err)
	}
	cctx, cancel := context.WithTimeout(ctx, p.cfg.CallTimeout)
	defer cancel()
	list, err := s.drv.Adapters(cctx)
	if err != nil {
		p.kick()
		return outcomeUnavailable, fmt.Errorf("listing the adapters of %s after loading %s: %w", s.spec.Pod, name, err)
	}
	if !slices.ContainsFunc(list, func(a engine.Adapter) bool { return a.Name == name }) {
		// Do not leave behind what the runtime half did.
		if err := s.drv.Unload(cctx, name); err != nil && !errors.Is(err, engine.ErrNotLoaded) {
			p.kick()
		}
		return outcomeUnlisted, fmt.Errorf("%s claims it loaded adapter %s but does not list it", s.spec.Pod, name)
	}
	return "", nil
}

// abandon frees the slot a failed load had reserved.
func (p *Pool) abandon(s *server, a *adapter) {
	p.mu.Lock()
	if s.adapters[a.name] == a {
		delete(s.adapters, a.name)
	}
	p.notifyLocked()
	p.mu.Unlock()
	p.unstage(a.stage)
}

// Release marks every adapter that owner used as no longer in use by it.
func (p *Pool) Release(owner string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	changed := false
	for _, s := range p.servers {
		for _, a := range s.adapters {
			if _, ok := a.users[owner]; ok {
				delete(a.users, owner)
				changed = true
			}
		}
	}
	if changed {
		p.notifyLocked()
	}
}

// Unpin lets the adapter name on the servers of base be evicted again
// (once no owner uses it); it reports whether any was pinned.
func (p *Pool) Unpin(base, name string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	found := false
	for _, s := range p.servers {
		if a := s.adapters[name]; s.spec.Base == base && a != nil && a.pinned {
			a.pinned, found = false, true
		}
	}
	if found {
		p.notifyLocked()
	}
	return found
}

// updateGaugesLocked sets the gauges from the servers.
func (p *Pool) updateGaugesLocked() {
	p.m.servers.Reset()
	p.m.baseMemory.Reset()
	used, free := 0, 0
	for _, s := range p.servers {
		state := "unhealthy"
		if s.healthy {
			state = "healthy"
		}
		p.m.servers.WithLabelValues(string(s.spec.Runtime), state).Inc()
		used += len(s.adapters)
		free += max(0, s.spec.Slots-len(s.adapters))
		if p.cfg.GPUUse != nil {
			p.m.baseMemory.WithLabelValues(s.spec.Base).Add(float64(s.gpuMem))
		}
	}
	p.m.slots.WithLabelValues("used").Set(float64(used))
	p.m.slots.WithLabelValues("free").Set(float64(free))
}
