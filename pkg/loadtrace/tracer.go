package loadtrace

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/podcgroup"
)

// Bounds the tracer keeps to, and what happens at each.
const (
	// MaxPrefixes is the most directories traced (ModelsDirs and BlobsDirs
	// together) and MaxPrefixLen the longest, with its trailing slash.
	MaxPrefixes  = 4
	MaxPrefixLen = 255
	// MaxFds is the most open traced files remembered, as in the kernel's
	// map; an open beyond it is counted as dropped (reason "bounds").
	MaxFds = 65536
)

// Config configures a Tracer. Zero values take the defaults documented.
type Config struct {
	// ModelsDirs are the absolute paths under which processes see the
	// cache's models directory: the host path (<cache root>/models) and any
	// path it is mounted at in pods. BlobsDirs likewise for
	// <cache root>/blobs/sha256. At most MaxPrefixes in all.
	ModelsDirs []string
	BlobsDirs  []string
	// StateDir is where the first-read orders persist (file orders.json);
	// empty keeps them in memory only.
	StateDir string
	// CgroupRoot is the cgroup v2 mount pods are resolved under; default
	// /sys/fs/cgroup.
	CgroupRoot string
	// PodName maps a pod UID to the name reported in Loads (for example
	// "namespace/name" from the Kubernetes watcher); default: the UID.
	PodName func(uid string) string
	// Quiet is how long a model's open count must stay 0 for its load to
	// end; default 2s.
	Quiet time.Duration
	// MaxLoadAge ends, unmeasured, a load still open after it (its closes
	// were lost); default 1h.
	MaxLoadAge time.Duration
	// MaxLoads bounds the loads in progress (pod and model pairs, so pods
	// too); a new load beyond it is not traced and its events are counted as
	// dropped (reason "bounds"). Default 1024.
	MaxLoads int
	// MaxFiles bounds the files of one load and of one recorded order; the
	// files beyond it are neither counted nor ordered. Default 4096.
	MaxFiles int
	// MaxModels bounds the models whose order is kept; beyond it the order
	// updated longest ago is forgotten. Default 1024.
	MaxModels int
	// Recent is how many ended loads Loads reports; default 256.
	Recent int
	// RingBytes is the ring buffer's size: a power of two, a multiple of
	// the page size; default 1 MiB.
	RingBytes int
	// Registerer receives the tracer's metrics; default none.
	Registerer prometheus.Registerer
	// Logger; default silent.
	Logger *slog.Logger
}

// Tracer traces model loads; see the package documentation. Run attaches
// it; Loads and Order are safe for concurrent use at any time.
type Tracer struct {
	cfg      Config
	log      *slog.Logger
	prefixes []string
	pods     *podcgroup.Resolver
	orders   *orderStore
	running  atomic.Bool
	m        metrics

	mu     sync.Mutex
	fds    map[fdKey]*openFile
	active map[loadKey]*load
	recent []api.ModelLoad // ring of ended loads, oldest first
}

type fdKey struct {
	tgid uint32
	fd   int32
}

type loadKey struct {
	pod, model string
}

type openFile struct {
	load *load
	file string
}

type load struct {
	key       loadKey
	pod       string // as reported
	blob      bool
	started   time.Time
	lastClose time.Time
	lastEvent time.Time
	open      int
	files     map[string]bool // file -> read
	order     []string
}

// Kinds of events, as the BPF program numbers them.
const (
	kindOpen  = 1
	kindRead  = 2
	kindClose = 3
	kindExit  = 4
)

var kindNames = [...]string{kindOpen: "open", kindRead: "read", kindClose: "close", kindExit: "exit"}

// event is one record of the ring buffer, its time made wall-clock.
type event struct {
	kind   uint32
	time   time.Time
	cgroup uint64
	tgid   uint32
	fd     int32
	path   string
}

// New returns a Tracer for cfg. It loads nothing into the kernel until Run;
// it reads the orders persisted in cfg.StateDir (a missing or unreadable
// file starts empty, logged).
func New(cfg Config) (*Tracer, error) {
	if cfg.CgroupRoot == "" {
		cfg.CgroupRoot = "/sys/fs/cgroup"
	}
	if cfg.Quiet <= 0 {
		cfg.Quiet = 2 * time.Second
	}
	if cfg.MaxLoadAge <= 0 {
		cfg.MaxLoadAge = time.Hour
	}
	if cfg.MaxLoads <= 0 {
		cfg.MaxLoads = 1024
	}
	if cfg.MaxFiles <= 0 {
		cfg.MaxFiles = 4096
	}
	if cfg.MaxModels <= 0 {
		cfg.MaxModels = 1024
	}
	if cfg.Recent <= 0 {
		cfg.Recent = 256
	}
	if cfg.RingBytes <= 0 {
		cfg.RingBytes = 1 << 20
	}
	if cfg.RingBytes&(cfg.RingBytes-1) != 0 {
		return nil, fmt.Errorf("loadtrace: ring buffer size %d is not a power of two", cfg.RingBytes)
	}
	var prefixes []string
	for _, d := range slices.Concat(cfg.ModelsDirs, cfg.BlobsDirs) {
		if !filepath.IsAbs(d) {
			return nil, fmt.Errorf("loadtrace: directory %q is not absolute", d)
		}
		p := filepath.Clean(d) + "/"
		if p == "//" || len(p) > MaxPrefixLen {
			return nil, fmt.Errorf("loadtrace: directory %q: the root or longer than %d bytes", d, MaxPrefixLen-1)
		}
		prefixes = append(prefixes, p)
	}
	if len(prefixes) == 0 || len(prefixes) > MaxPrefixes {
		return nil, fmt.Errorf("loadtrace: %d directories, want 1 to %d", len(prefixes), MaxPrefixes)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	t := &Tracer{
		cfg:      cfg,
		log:      log,
		prefixes: prefixes,
		pods:     podcgroup.NewResolver(cfg.CgroupRoot),
		fds:      make(map[fdKey]*openFile),
		active:   make(map[loadKey]*load),
	}
	t.orders = newOrderStore(cfg.StateDir, cfg.MaxModels, cfg.MaxFiles, log)
	if err := t.m.register(cfg.Registerer, t); err != nil {
		return nil, err
	}
	return t, nil
}

// Run attaches the tracer and aggregates its events until ctx is done. If
// the BPF program cannot be loaded or attached, Run logs once, leaves
// weightd_loadtrace_available at 0 and returns nil.
func (t *Tracer) Run(ctx context.Context) error {
	if !t.running.CompareAndSwap(false, true) {
		return errors.New("loadtrace: Run called twice")
	}
	p, err := attach(t.cfg, t.prefixes)
	if err != nil {
		t.log.Warn("model-load tracer unavailable; the agent works without it", "err", err)
		return nil
	}
	defer p.close()
	t.m.drops.setSource(p.drops)
	defer t.m.drops.setSource(nil)
	t.m.available.Set(1)
	defer t.m.available.Set(0)
	t.log.Info("model-load tracer attached", "dirs", t.prefixes)

	done := make(chan error, 1)
	go func() { done <- p.read(t.handle) }()
	tick := time.NewTicker(max(t.cfg.Quiet/4, 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			p.stop()
			if err := <-done; err != nil {
				return fmt.Errorf("reading the model-load trace: %w", err)
			}
			return nil
		case err := <-done:
			return fmt.Errorf("reading the model-load trace: %w", err)
		case now := <-tick.C:
			t.tick(now)
		}
	}
}

// Loads returns the loads in progress and the last ended ones, by start.
func (t *Tracer) Loads() []api.ModelLoad {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := slices.Clone(t.recent)
	for _, l := range t.active {
		out = append(out, l.report(l.lastEvent))
	}
	slices.SortStableFunc(out, func(a, b api.ModelLoad) int { return a.Started.Compare(b.Started) })
	return out
}

// Order returns the files of model ("org/name@revision", or "org/name" for
// its latest recorded revision) in the order they were first read the last
// time a pod loaded it, relative to the model directory; nil if unknown. It
// implements prefetch.FileOrder.
func (t *Tracer) Order(model string) []string { return t.orders.get(model) }

func (l *load) report(end time.Time) api.ModelLoad {
	return api.ModelLoad{
		Pod:     l.pod,
		Model:   l.key.model,
		Started: l.started,
		Seconds: end.Sub(l.started).Seconds(),
		Files:   len(l.files),
		Open:    l.open,
		Order:   slices.Clone(l.order),
	}
}

// handle folds one event into the loads.
func (t *Tracer) handle(ev event) {
	if int(ev.kind) < len(kindNames) && kindNames[ev.kind] != "" {
		t.m.events.WithLabelValues(kindNames[ev.kind]).Inc()
	}
	switch ev.kind {
	case kindOpen:
		t.open(ev)
	case kindRead:
		t.mu.Lock()
		if f := t.fds[fdKey{ev.tgid, ev.fd}]; f != nil {
			f.load.read(f.file, t.cfg.MaxFiles)
			f.load.lastEvent = ev.time
		}
		t.mu.Unlock()
	case kindClose:
		t.mu.Lock()
		t.closeFd(fdKey{ev.tgid, ev.fd}, ev.time)
		t.mu.Unlock()
	case kindExit:
		t.mu.Lock()
		for k := range t.fds {
			if k.tgid == ev.tgid {
				t.closeFd(k, ev.time)
			}
		}
		t.mu.Unlock()
	}
}

func (t *Tracer) open(ev event) {
	model, file, blob, ok := classify(t.prefixes[:len(t.cfg.ModelsDirs)], t.prefixes[len(t.cfg.ModelsDirs):], ev.path)
	if !ok {
		return
	}
	var uid string
	if pod, err := t.pods.FromCgroupID(ev.cgroup); err == nil {
		uid = pod.UID
	}
	name := uid
	if uid != "" && t.cfg.PodName != nil {
		name = t.cfg.PodName(uid)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	k := fdKey{ev.tgid, ev.fd}
	// An fd opened again was closed unseen (dup2, close_range, a lost close).
	t.closeFd(k, ev.time)
	key := loadKey{uid, model}
	l := t.active[key]
	if l == nil {
		if len(t.active) >= t.cfg.MaxLoads || len(t.fds) >= MaxFds {
			t.m.drops.bounds.Add(1)
			return
		}
		l = &load{key: key, pod: name, blob: blob, started: ev.time, files: make(map[string]bool)}
		t.active[key] = l
	} else if len(t.fds) >= MaxFds {
		t.m.drops.bounds.Add(1)
		return
	}
	l.open++
	l.lastEvent = ev.time
	if _, seen := l.files[file]; !seen && len(l.files) < t.cfg.MaxFiles {
		l.files[file] = false
	}
	t.fds[k] = &openFile{load: l, file: file}
}

// read records the first read of file in the load's order.
func (l *load) read(file string, maxFiles int) {
	read, ok := l.files[file]
	if !ok || read || len(l.order) >= maxFiles {
		return
	}
	l.files[file] = true
	l.order = append(l.order, file)
}

// closeFd ends an open file, if k is one; t.mu is held.
func (t *Tracer) closeFd(k fdKey, at time.Time) {
	f := t.fds[k]
	if f == nil {
		return
	}
	delete(t.fds, k)
	f.load.open--
	f.load.lastEvent = at
	if f.load.open == 0 {
		f.load.lastClose = at
	}
}

// tick ends the loads whose files have all been closed for the quiet
// period, and drops those open past MaxLoadAge.
func (t *Tracer) tick(now time.Time) {
	var ended []*load
	t.mu.Lock()
	for key, l := range t.active {
		switch {
		case l.open == 0 && now.Sub(l.lastClose) >= t.cfg.Quiet:
			delete(t.active, key)
			t.end(l)
			ended = append(ended, l)
		case l.open > 0 && now.Sub(l.started) >= t.cfg.MaxLoadAge:
			delete(t.active, key)
			for k, f := range t.fds {
				if f.load == l {
					delete(t.fds, k)
				}
			}
			t.log.Debug("model load never closed; dropped", "pod", l.pod, "model", l.key.model)
		}
	}
	t.mu.Unlock()
	// Persisting (an fsync) waits outside the lock: events keep flowing.
	for _, l := range ended {
		if l.blob || len(l.order) == 0 {
			continue
		}
		if err := t.orders.set(l.key.model, l.order, l.lastClose); err != nil {
			t.log.Warn("persisting model file order", "model", l.key.model, "err", err)
		}
	}
}

// end reports a load that ended; t.mu is held.
func (t *Tracer) end(l *load) {
	r := l.report(l.lastClose)
	t.m.seconds.Observe(r.Seconds)
	if len(t.recent) >= t.cfg.Recent {
		t.recent = slices.Delete(t.recent, 0, 1)
	}
	t.recent = append(t.recent, r)
	t.log.Debug("model loaded", "pod", r.Pod, "model", r.Model, "seconds", r.Seconds, "files", r.Files)
}
