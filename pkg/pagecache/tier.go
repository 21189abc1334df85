package pagecache

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"golang.org/x/time/rate"
)

var (
	// ErrInvalid is a bad argument: a negative budget, an empty owner, a
	// path that is not a regular file.
	ErrInvalid = errors.New("invalid argument")
	// ErrOverBudget is a file left out because it did not fit in what was
	// left of the budget.
	ErrOverBudget = errors.New("over the DRAM tier's budget")
	// ErrChanged is a kept file that was replaced or changed size since its
	// owner kept it; it is dropped until the owner keeps it again.
	ErrChanged = errors.New("file changed since it was kept")
)

// Tier keeps files in the page cache within a memory budget. Build it with
// New; its methods are safe for concurrent use.
type Tier struct {
	budget  int64
	opts    options
	m       *metrics
	sem     chan struct{} // one token per reader
	limiter *rate.Limiter // nil when the read rate is not bounded
	bufs    sync.Pool     // *[]byte of warmChunk
	// lockMem and unlockMem are mlock and munlock; tests replace lockMem.
	lockMem, unlockMem func([]byte) error

	mu       sync.Mutex
	owners   []*holder         // in the order of their first Keep
	open     map[fileID]*file  // kept files
	entries  []*entry          // distinct files of the last plan, in order
	byID     map[fileID]*entry // entries by file
	mlockOK  bool
	lockCap  int64             // most bytes to lock: the budget, or half the cgroup's memory.max
	reported map[string]string // path → problem last logged
}

// New returns a tier that keeps at most budget bytes. It starts nothing:
// call Keep to keep files and Run to keep them resident.
func New(budget int64, opts ...Option) (*Tier, error) {
	if budget < 0 {
		return nil, fmt.Errorf("%w: budget %d bytes", ErrInvalid, budget)
	}
	o := defaultOptions()
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	m, err := newMetrics(o.registerer)
	if err != nil {
		return nil, fmt.Errorf("registering DRAM tier metrics: %w", err)
	}
	t := &Tier{
		budget: budget, opts: o, m: m,
		sem:     make(chan struct{}, o.readers),
		bufs:    sync.Pool{New: func() any { b := make([]byte, warmChunk); return &b }},
		lockMem: unix.Mlock, unlockMem: unix.Munlock,
		open: map[fileID]*file{}, byID: map[fileID]*entry{},
		mlockOK: o.mlock, lockCap: budget, reported: map[string]string{},
	}
	if limit := cgroupMemoryMax(); limit > 0 {
		t.lockCap = min(budget, limit/2)
	}
	if o.rate > 0 {
		t.limiter = rate.NewLimiter(rate.Limit(o.rate), warmChunk)
	}
	m.budget.Set(float64(budget))
	m.mlockAvailable.Set(b2f(t.mlockOK))
	return t, nil
}

// Status is what the tier holds, as of its last check.
type Status struct {
	Budget int64 `json:"budget_bytes"`
	// Kept is the size of the files kept, each counted once.
	Kept int64 `json:"kept_bytes"`
	// Resident is how much of them was in the page cache at the last check.
	Resident int64 `json:"resident_bytes"`
	// Locked is how much of them is locked in memory.
	Locked int64 `json:"locked_bytes"`
	// MlockAvailable is false once the kernel refused to lock a file (or
	// WithMlock(false)): files are then kept by re-warming.
	MlockAvailable bool `json:"mlock_available"`
	// Files are the files asked for, kept or not, in admission order; files
	// that could not be resolved when they were kept come last.
	Files []FileStatus `json:"files"`
}

// FileStatus is one file asked of the tier.
type FileStatus struct {
	// Path is the file with its symlinks resolved (as given when it could
	// not be resolved).
	Path string `json:"path"`
	// Owners are the owners that keep it.
	Owners   []string `json:"owners"`
	Size     int64    `json:"size"`
	Kept     bool     `json:"kept"`
	Resident int64    `json:"resident_bytes"`
	Locked   bool     `json:"locked"`
	// Err says why a file is not kept: ErrOverBudget, ErrChanged, or the
	// error of resolving or opening it. Error is its text.
	Err   error  `json:"-"`
	Error string `json:"error,omitempty"`
}

// fileID is a file's identity: two paths to one inode are one file.
type fileID struct{ dev, ino uint64 }

// want is a file an owner asked for, as resolved when it was kept.
type want struct {
	path     string // as given, or found under a given directory
	resolved string
	id       fileID
	size     int64
	err      error // resolving it failed
}

// holder is an owner and the files it keeps.
type holder struct {
	name  string
	wants []want
}

// file is a kept file: open and mapped. Its fields but f are guarded by
// Tier.mu; f may be read from without it (os.File reads are safe against a
// concurrent Close).
type file struct {
	id       fileID
	path     string
	size     int64
	f        *os.File
	mem      []byte // nil for an empty file
	locked   bool
	resident int64
	closed   bool
}

// entry is one distinct file of a plan, kept or not.
type entry struct {
	id     fileID
	path   string
	size   int64
	owners []string
	file   *file // when kept
	err    error // why not kept
}

// Keep keeps paths for owner, replacing what owner kept before (an owner
// keeps its place in the admission order). A path may be a file or a
// directory, whose regular files (symlinks followed) are taken in lexical
// order. Keep reads the files in and locks them where allowed before it
// returns; it returns an error naming every file of owner that is not kept
// (over the budget, unresolvable, changed), and ctx's error if ctx ended
// before they were read in (they stay kept; Run reads them in).
func (t *Tier) Keep(ctx context.Context, owner string, paths []string) error {
	if owner == "" {
		return fmt.Errorf("%w: empty owner", ErrInvalid)
	}
	wants := resolve(paths)
	t.mu.Lock()
	if i := t.ownerIndex(owner); i >= 0 {
		t.owners[i].wants = wants
	} else {
		t.owners = append(t.owners, &holder{name: owner, wants: wants})
	}
	t.mu.Unlock()
	t.refresh(ctx, true)
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("reading in the files of %s: %w", owner, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := t.ownerIndex(owner)
	if i < 0 {
		return nil // released meanwhile
	}
	var errs []error
	seen := map[fileID]bool{}
	for _, w := range t.owners[i].wants {
		switch e := t.byID[w.id]; {
		case w.err != nil:
			errs = append(errs, w.err)
		case seen[w.id]:
		case e != nil && e.err != nil:
			errs = append(errs, e.err)
		}
		seen[w.id] = true
	}
	return errors.Join(errs...)
}

// Release stops keeping owner's files: files no other owner keeps are
// unlocked and unmapped, and files left out before may now be admitted
// (they are read in at the next check). Releasing an unknown owner does
// nothing.
func (t *Tier) Release(owner string) {
	t.mu.Lock()
	t.owners = slices.DeleteFunc(t.owners, func(o *holder) bool { return o.name == owner })
	t.mu.Unlock()
	t.refresh(context.Background(), false)
}

// Check checks the kept files once, the way Run does periodically: it drops
// files that changed or disappeared, admits what fits, reads back what the
// kernel dropped from the page cache, locks what may be locked and measures
// residency. It returns the problems of every file not kept, joined (also
// logged, once per change), or ctx's error.
func (t *Tier) Check(ctx context.Context) error {
	t.refresh(ctx, true)
	if err := ctx.Err(); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var errs []error
	for _, e := range t.entries {
		if e.err != nil {
			errs = append(errs, e.err)
		}
	}
	for _, o := range t.owners {
		for _, w := range o.wants {
			if w.err != nil {
				errs = append(errs, w.err)
			}
		}
	}
	return errors.Join(errs...)
}

// Run calls Check every interval (WithInterval) until ctx ends; problems
// with files are logged, and are no reason to stop.
func (t *Tier) Run(ctx context.Context) error {
	if t.lockCap < t.budget {
		t.opts.logger.Warn("the DRAM tier's budget is over half of the agent's memory limit: the page cache it reads in counts against that limit and will be reclaimed, and it locks at most half the limit; raise the limit by the budget",
			"budget", t.budget, "lock_cap", t.lockCap)
	}
	tick := time.NewTicker(t.opts.interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			_ = t.Check(ctx) // logged by refresh
		}
	}
}

// Status returns what the tier holds, as of its last check.
func (t *Tier) Status() Status {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := Status{Budget: t.budget, MlockAvailable: t.mlockOK}
	for _, e := range t.entries {
		fs := FileStatus{Path: e.path, Owners: slices.Clone(e.owners), Size: e.size, Err: e.err}
		if f := e.file; f != nil {
			fs.Kept, fs.Resident, fs.Locked = true, f.resident, f.locked
			s.Kept += f.size
			s.Resident += f.resident
			if f.locked {
				s.Locked += f.size
			}
		}
		if e.err != nil {
			fs.Error = e.err.Error()
		}
		s.Files = append(s.Files, fs)
	}
	for _, o := range t.owners {
		for _, w := range o.wants {
			if w.err != nil {
				s.Files = append(s.Files, FileStatus{Path: w.path, Owners: []string{o.name}, Err: w.err, Error: w.err.Error()})
			}
		}
	}
	return s
}

func (t *Tier) ownerIndex(name string) int {
	return slices.IndexFunc(t.owners, func(o *holder) bool { return o.name == name })
}

// refresh plans (which files are kept), reads in the kept files when warm
// (with the lock released: reads go through each file's own descriptor),
// locks them when warm, measures residency and publishes the result.
func (t *Tier) refresh(ctx context.Context, warm bool) {
	t.mu.Lock()
	t.plan()
	var kept []*file
	for _, e := range t.entries {
		if e.file != nil {
			kept = append(kept, e.file)
		}
	}
	t.mu.Unlock()

	if warm {
		t.warmAll(ctx, kept)
	}

	t.mu.Lock()
	defer t.mu.Unlock()
	for _, f := range kept {
		if f.closed {
			continue
		}
		if warm && ctx.Err() == nil {
			t.lock(f)
		}
		f.resident = t.residency(f)
	}
	t.publish()
}

// plan lists the distinct files of every owner in admission order, checks
// that each is still the file its owner kept, admits those that fit in the
// budget (opening and mapping the new ones) and closes the kept files that
// are no longer admitted. Called with t.mu held.
func (t *Tier) plan() {
	var order []*entry
	byID := map[fileID]*entry{}
	for _, o := range t.owners {
		for _, w := range o.wants {
			if w.err != nil {
				continue
			}
			if e := byID[w.id]; e != nil {
				if !slices.Contains(e.owners, o.name) {
					e.owners = append(e.owners, o.name)
				}
				continue
			}
			e := &entry{id: w.id, path: w.resolved, size: w.size, owners: []string{o.name}}
			byID[w.id] = e
			order = append(order, e)
		}
	}
	var used int64
	for _, e := range order {
		f, err := t.verify(e)
		if err != nil {
			e.err = err
			continue
		}
		if used+e.size > t.budget {
			e.err = fmt.Errorf("%s: %w: %d bytes, %d of %d left", e.path, ErrOverBudget, e.size, t.budget-used, t.budget)
			if t.open[e.id] != f {
				t.closeFile(f)
			}
			continue
		}
		used += e.size
		e.file = f
		t.open[e.id] = f
	}
	for id, f := range t.open {
		if e := byID[id]; e == nil || e.file != f {
			t.closeFile(f)
			delete(t.open, id)
		}
	}
	t.entries, t.byID = order, byID
}

// verify checks that e's path is still the file its owner kept and returns
// it open: the kept one, or newly opened and mapped.
func (t *Tier) verify(e *entry) (*file, error) {
	st, err := os.Stat(e.path)
	if err != nil {
		return nil, fmt.Errorf("checking %s: %w", e.path, err)
	}
	if err := same(e, st); err != nil {
		return nil, err
	}
	if f := t.open[e.id]; f != nil {
		return f, nil
	}
	osf, err := os.Open(e.path)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", e.path, err)
	}
	if st, err = osf.Stat(); err == nil {
		err = same(e, st)
	}
	if err != nil {
		osf.Close()
		return nil, err
	}
	f := &file{id: e.id, path: e.path, size: e.size, f: osf}
	if e.size > 0 {
		if f.mem, err = unix.Mmap(int(osf.Fd()), 0, int(e.size), unix.PROT_READ, unix.MAP_SHARED); err != nil {
			osf.Close()
			return nil, fmt.Errorf("mapping %s: %w", e.path, err)
		}
	}
	return f, nil
}

// same checks that st is the file e was kept as.
func same(e *entry, st fs.FileInfo) error {
	if id := idOf(st); id != e.id || st.Size() != e.size {
		return fmt.Errorf("%s: %w: kept as inode %d of %d bytes, now inode %d of %d bytes", e.path, ErrChanged, e.id.ino, e.size, id.ino, st.Size())
	}
	return nil
}

// closeFile unlocks, unmaps and closes f. Called with t.mu held.
func (t *Tier) closeFile(f *file) {
	if f.locked {
		if err := t.unlockMem(f.mem); err != nil {
			t.opts.logger.Warn("unlocking file", "path", f.path, "err", err)
		}
		f.locked = false
	}
	if f.mem != nil {
		if err := unix.Munmap(f.mem); err != nil {
			t.opts.logger.Warn("unmapping file", "path", f.path, "err", err)
		}
		f.mem = nil
	}
	f.f.Close()
	f.closed, f.resident = true, 0
}

// publish sets the metrics from the last plan and logs each file's problem
// once per change. Called with t.mu held.
func (t *Tier) publish() {
	var kept, resident, locked int64
	counts := map[string]int{}
	problems := map[string]string{}
	for _, e := range t.entries {
		switch {
		case e.file != nil:
			counts[stateKept]++
			kept += e.size
			resident += e.file.resident
			if e.file.locked {
				locked += e.size
			}
		case errors.Is(e.err, ErrOverBudget):
			counts[stateOverBudget]++
			problems[e.path] = e.err.Error()
		default:
			counts[stateFailed]++
			problems[e.path] = e.err.Error()
		}
	}
	for _, o := range t.owners {
		for _, w := range o.wants {
			if w.err != nil {
				counts[stateFailed]++
				problems[w.path] = w.err.Error()
			}
		}
	}
	for p, msg := range problems {
		if t.reported[p] != msg {
			t.opts.logger.Warn("file not kept in the DRAM tier", "path", p, "err", msg)
		}
	}
	t.reported = problems
	t.m.kept.Set(float64(kept))
	t.m.resident.Set(float64(resident))
	t.m.locked.Set(float64(locked))
	t.m.mlockAvailable.Set(b2f(t.mlockOK))
	for _, s := range []string{stateKept, stateOverBudget, stateFailed} {
		t.m.files.WithLabelValues(s).Set(float64(counts[s]))
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
