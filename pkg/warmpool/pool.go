package warmpool

import (
	"cmp"
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
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// Fetcher brings an adapter into the local cache. QueueFetcher implements
// it with the agent's prefetch queue (cache and swarm).
type Fetcher interface {
	// Fetch fetches the adapter at ref and returns the directory holding
	// its files (adapter_config.json, the safetensors weights). ctx names
	// the pod's namespace the fetch is for (prefetch.Requester), which
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
}

// DefaultConfig returns the defaults of the optional fields.
func DefaultConfig() Config {
	return Config{HealthInterval: 10 * time.Second, CallTimeout: 5 * time.Second, LoadTimeout: 60 * time.Second}
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
	servers map[string]*server // by pod namespace/name
	flights map[string]*flight // by flightKey(base, name)
	seq     uint64             // counts state changes; orders a listing against loads
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

// SetServers replaces the set of warm servers, as discovery found them. A
// new server is listed (its adapters adopted: after a restart of the agent
// nothing is lost) and its base kept by Run; a server gone, or whose spec
// changed, is forgotten and its base dropped if kept (a base found down
// was dropped then, and one being kept is dropped once Keep returns).
// Invalid specs are logged and skipped.
func (p *Pool) SetServers(specs []ServerSpec) {
	var dropped []ServerSpec
	added := false
	p.mu.Lock()
	seen := make(map[string]bool, len(specs))
	for _, spec := range specs {
		if err := validSpec(spec); err != nil {
			p.log.Warn("ignoring warm server", "pod", spec.Pod, "err", err)
			continue
		}
		seen[spec.Pod] = true
		old := p.servers[spec.Pod]
		if old != nil && old.spec == spec {
			continue
		}
		drv, err := p.cfg.Drivers(spec.Runtime, spec.Endpoint)
		if err != nil {
			p.log.Warn("ignoring warm server", "pod", spec.Pod, "err", err)
			delete(seen, spec.Pod)
			continue
		}
		if old != nil && old.kept {
			dropped = append(dropped, old.spec)
		}
		added = true
		p.servers[spec.Pod] = &server{spec: spec, drv: drv, adapters: make(map[string]*adapter), unloading: make(map[string]uint64)}
		p.log.Info("warm server added", "pod", spec.Pod, "base", spec.Base, "runtime", spec.Runtime, "endpoint", spec.Endpoint, "slots", spec.Slots)
	}
	for pod, s := range p.servers {
		if !seen[pod] {
			delete(p.servers, pod)
			if s.kept {
				dropped = append(dropped, s.spec)
			}
			p.log.Info("warm server removed", "pod", pod, "base", s.spec.Base)
		}
	}
	if !added && len(dropped) == 0 {
		p.mu.Unlock()
		return
	}
	p.notifyLocked()
	p.mu.Unlock()
	for _, s := range dropped {
		p.cfg.Bases.Drop(s)
	}
	p.kick()
}

func validSpec(s ServerSpec) error {
	switch {
	case s.Pod == "":
		return errors.New("no pod name")
	case s.Base == "":
		return errors.New("no base model")
	case s.Endpoint == "":
		return errors.New("no endpoint")
	case s.Slots < 1:
		return fmt.Errorf("%d adapter slots", s.Slots)
	case s.MaxRank < 0:
		return fmt.Errorf("max rank %d", s.MaxRank)
	}
	return nil
}

// Servers describes the warm servers and their loaded adapters, sorted by
// pod.
func (p *Pool) Servers() []api.WarmServer {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]api.WarmServer, 0, len(p.servers))
	for _, s := range p.servers {
		ws := api.WarmServer{
			Pod: s.spec.Pod, Base: s.spec.Base, Runtime: string(s.spec.Runtime), Endpoint: s.spec.Endpoint,
			Healthy: s.healthy, Error: s.err, Slots: s.spec.Slots, GPUs: slices.Clone(s.gpus),
			Adapters: []api.LoadedAdapter{},
		}
		for _, a := range s.adapters {
			if a.loading {
				continue
			}
			ws.Adapters = append(ws.Adapters, api.LoadedAdapter{
				Name: a.name, Ref: a.ref, LastUsed: a.lastUsed, Pinned: a.pinned, InUse: len(a.users),
			})
		}
		slices.SortFunc(ws.Adapters, func(a, b api.LoadedAdapter) int { return cmp.Compare(a.Name, b.Name) })
		out = append(out, ws)
	}
	slices.SortFunc(out, func(a, b api.WarmServer) int { return cmp.Compare(a.Pod, b.Pod) })
	return out
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
		p.useLocked(a, owner, req.Pin)
		p.notifyLocked()
		return api.AdapterAnswer{Server: s.spec.Pod, Endpoint: s.spec.Endpoint, Model: name}, true, nil
	}
	return api.AdapterAnswer{}, false, nil
}

func (p *Pool) useLocked(a *adapter, owner string, pin bool) {
	a.lastUsed = time.Now()
	if owner != "" {
		if a.users == nil {
			a.users = make(map[string]struct{})
		}
		a.users[owner] = struct{}{}
	}
	if pin {
		a.pinned = true
	}
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

func (p *Pool) sortedLocked() []*server {
	out := make([]*server, 0, len(p.servers))
	for _, s := range p.servers {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b *server) int { return cmp.Compare(a.spec.Pod, b.spec.Pod) })
	return out
}

// load fetches, checks and stages the adapter, reserves a slot (evicting
// the least recently used adapter if it must), loads it and verifies that
// the server lists it. The caller holds the adapter's flight.
func (p *Pool) load(ctx context.Context, owner string, req api.AdapterRequest, name string, start time.Time) (api.AdapterAnswer, error) {
	dir, err := p.cfg.Fetcher.Fetch(prefetch.WithRequester(ctx, req.Namespace), req.Ref)
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
		p.useLocked(a, owner, req.Pin)
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
	p.useLocked(a, owner, req.Pin)
	p.notifyLocked()
	p.log.Info("adapter loaded", "adapter", name, "ref", req.Ref, "server", s.spec.Pod, "evicted", victimName(victim), "seconds", time.Since(start).Seconds())
	return api.AdapterAnswer{Server: s.spec.Pod, Endpoint: s.spec.Endpoint, Model: name, Loaded: true}, nil
}

func victimName(a *adapter) string {
	if a == nil {
		return ""
	}
	return a.name
}

// reserveLocked chooses a server of base that serves namespace for the
// adapter: a healthy one whose maximum rank allows it, with a free slot (the
// most free first), else the one holding the least recently used evictable
// adapter (the victim).
func (p *Pool) reserveLocked(base, namespace, name string, rank int) (*server, *adapter, error) {
	if s, a := p.adoptedLocked(base, namespace, name); a != nil {
		// Found loaded after a restart with other files: replace it in place.
		if !a.evictable() {
			return nil, nil, fmt.Errorf("%w: adapter %s on %s holds other weights and is in use", api.ErrBusy, name, s.spec.Pod)
		}
		return s, a, nil
	}
	var cands []*server
	maxRank := 0
	for _, s := range p.sortedLocked() {
		if s.spec.Base != base || !s.healthy || !s.synced || s.adapters[name] != nil || !s.spec.serves(namespace) {
			continue
		}
		if s.spec.MaxRank > 0 && rank > s.spec.MaxRank {
			maxRank = max(maxRank, s.spec.MaxRank)
			continue
		}
		cands = append(cands, s)
	}
	if len(cands) == 0 {
		if maxRank > 0 {
			return nil, nil, fmt.Errorf("%w: adapter %s has rank %d, over the maximum of the servers of %s (%d)", api.ErrBadRequest, name, rank, base, maxRank)
		}
		if err := p.baseServedLocked(base, namespace); err != nil {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("%w: no healthy warm server of base %s", api.ErrBusy, base)
	}
	var best *server
	for _, s := range cands {
		if free := s.spec.Slots - len(s.adapters); free > 0 && (best == nil || free > best.spec.Slots-len(best.adapters)) {
			best = s
		}
	}
	if best != nil {
		return best, nil, nil
	}
	var victim *adapter
	for _, s := range cands {
		for _, a := range s.adapters {
			if a.evictable() && (victim == nil || a.lastUsed.Before(victim.lastUsed)) {
				best, victim = s, a
			}
		}
	}
	if victim == nil {
		return nil, nil, fmt.Errorf("%w: every adapter slot of the warm servers of %s holds an adapter that is pinned, in use or loading", api.ErrBusy, base)
	}
	return best, victim, nil
}

// runtimePinLocked reports whether s may be asked to pin one more adapter.
// SGLang refuses a pin once max_loras_per_batch − 1 adapters are pinned, so
// that one batch slot stays for the others and the base model
// (python/sglang/srt/lora/lora_manager.py, validate_new_adapter); Slots is
// that flag for SGLang. The pool's own pin still keeps an adapter loaded
// without it unevicted. vLLM has no pinning: the flag is ignored there.
func runtimePinLocked(s *server) bool {
	if s.spec.Runtime != engine.SGLang {
		return true
	}
	pinned := 0
	for _, a := range s.adapters {
		if a.runtimePinned {
			pinned++
		}
	}
	return pinned < s.spec.Slots-1
}

// adoptedLocked finds the adapter name that a healthy server of base serving
// namespace was found holding after a restart of the agent, whose reference
// is not known yet.
func (p *Pool) adoptedLocked(base, namespace, name string) (*server, *adapter) {
	for _, s := range p.sortedLocked() {
		if s.spec.Base != base || !s.healthy || !s.synced || !s.spec.serves(namespace) {
			continue
		}
		if a := s.adapters[name]; a != nil && !a.loading && a.ref == "" {
			return s, a
		}
	}
	return nil, nil
}

// evict unloads victim from s, whose slot the caller has taken over.
func (p *Pool) evict(ctx context.Context, s *server, victim *adapter) error {
	cctx, cancel := context.WithTimeout(ctx, p.cfg.CallTimeout)
	err := s.drv.Unload(cctx, victim.name)
	cancel()
	p.mu.Lock()
	p.seq++
	s.unloading[victim.name] = p.seq
	p.mu.Unlock()
	if err != nil && !errors.Is(err, engine.ErrNotLoaded) {
		p.kick()
		return fmt.Errorf("evicting adapter %s from %s: %w", victim.name, s.spec.Pod, err)
	}
	p.m.evictions.WithLabelValues(string(s.spec.Runtime)).Inc()
	p.log.Info("adapter evicted", "adapter", victim.name, "server", s.spec.Pod, "lastUsed", victim.lastUsed)
	p.unstage(victim.stage)
	return nil
}

// stageOnce stages the adapter files of dir under StageDir/stage unless
// they are there already (stage names their content).
func (p *Pool) stageOnce(stage, dir string) error {
	p.stageMu.Lock()
	defer p.stageMu.Unlock()
	if _, err := os.Stat(filepath.Join(p.cfg.StageDir, stage)); err == nil {
		return nil
	}
	return stageDir(p.cfg.StageDir, stage, dir)
}

// unstage removes StageDir/stage when no server holds or loads an adapter
// from it.
func (p *Pool) unstage(stage string) {
	if stage == "" {
		return
	}
	p.stageMu.Lock()
	defer p.stageMu.Unlock()
	p.mu.Lock()
	for _, s := range p.servers {
		for _, a := range s.adapters {
			if a.stage == stage {
				p.mu.Unlock()
				return
			}
		}
	}
	p.mu.Unlock()
	if err := os.RemoveAll(filepath.Join(p.cfg.StageDir, stage)); err != nil {
		p.log.Warn("removing a staged adapter", "stage", stage, "err", err)
	}
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
