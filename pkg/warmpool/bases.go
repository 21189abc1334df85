package warmpool

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/pagecache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

// QueueFetcher fetches adapters through the prefetch queue (cache and
// swarm), at the priority of a waiting pod.
type QueueFetcher struct{ Queue *prefetch.Queue }

func (f QueueFetcher) Fetch(ctx context.Context, ref string) (string, error) {
	j, err := submitAndWait(ctx, f.Queue, ref, prefetch.PriorityPod, prefetch.ForNamespace(source.Requester(ctx)))
	if err != nil {
		return "", err
	}
	return j.Status().Dir, nil
}

// submitAndWait submits reference and waits for its job; a reference that
// does not parse is an api.ErrBadRequest.
func submitAndWait(ctx context.Context, q *prefetch.Queue, reference string, p prefetch.Priority, opts ...prefetch.SubmitOption) (*prefetch.Job, error) {
	j, err := q.Submit(reference, p, opts...)
	if errors.Is(err, ref.ErrInvalid) {
		return nil, fmt.Errorf("%w: %w", api.ErrBadRequest, err)
	}
	if err != nil {
		return nil, err
	}
	if _, err := j.Wait(ctx); err != nil {
		return nil, err
	}
	return j, nil
}

// PinPrefix starts the pin owner of a warm server's base blobs:
// "warm:<namespace>/<pod>".
const PinPrefix = "warm:"

// NewBasePinner returns the Bases that keeps the base model of each warm
// server fetched through queue and its blobs pinned in store under the
// owner "warm:<pod>", as long as all warm pins stay within share percent
// of the cache budget, and, with a DRAM tier (nil: none), their files in
// memory under the same owner.
func NewBasePinner(queue *prefetch.Queue, store *cache.Store, dram *pagecache.Tier, share int, log *slog.Logger) Bases {
	return &basePinner{queue: queue, store: store, dram: dram, log: log, share: share}
}

type basePinner struct {
	queue *prefetch.Queue
	store *cache.Store
	dram  *pagecache.Tier // nil: no DRAM tier
	log   *slog.Logger
	share int // percent of the cache budget
	// mu orders the share check and the pins of concurrent Keeps.
	mu sync.Mutex
}

func (b *basePinner) Keep(ctx context.Context, s ServerSpec) error {
	// On behalf of the server pod's namespace: its base is what it named.
	ns, _, _ := strings.Cut(s.Pod, "/")
	j, err := submitAndWait(ctx, b.queue, s.Base, prefetch.PriorityNormal, prefetch.ForNamespace(ns))
	if err != nil {
		return fmt.Errorf("fetching base %s: %w", s.Base, err)
	}
	owner := PinPrefix + s.Pod
	paths, err := b.pin(s.Base, owner, j.Blobs())
	if err != nil {
		return err
	}
	if b.dram != nil {
		// Over the budget or not, the base is served: the tier says which
		// files it left out, and keeps trying as others are released.
		if err := b.dram.Keep(ctx, owner, paths); err != nil {
			b.log.Warn("DRAM tier keeps only part of a warm base", "pod", s.Pod, "base", s.Base, "err", err)
		}
	}
	return nil
}

// pin pins blobs for owner, unless the blobs pinned for every warm server
// would then exceed the share of the cache budget; it returns the blobs'
// paths.
func (b *basePinner) pin(base, owner string, blobs []content.Descriptor) ([]string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	limit := b.store.Usage().BudgetBytes / 100 * int64(b.share)
	counted := make(map[digest.Digest]bool)
	var total int64
	for _, info := range b.store.List() {
		if slices.ContainsFunc(info.Pins, func(p string) bool { return strings.HasPrefix(p, PinPrefix) && p != owner }) {
			counted[info.Digest] = true
			total += info.Size
		}
	}
	for _, d := range blobs {
		if !counted[d.Digest] {
			counted[d.Digest] = true
			total += d.Size
		}
	}
	if total > limit {
		return nil, fmt.Errorf("not pinning base %s: warm servers' bases would pin %d bytes, over --warm-pin-budget-percent (%d%% of the cache budget: %d bytes)",
			base, total, b.share, limit)
	}
	var paths []string
	for _, d := range blobs {
		if err := b.store.Pin(d.Digest, owner); err != nil {
			return nil, fmt.Errorf("pinning base %s: %w", base, err)
		}
		if p, err := b.store.BlobPath(d.Digest); err == nil {
			paths = append(paths, p)
		}
	}
	return paths, nil
}

// Drop unpins every blob pinned for s, including pins an earlier agent left.
func (b *basePinner) Drop(s ServerSpec) {
	owner := PinPrefix + s.Pod
	if b.dram != nil {
		b.dram.Release(owner)
	}
	for _, info := range b.store.List() {
		if slices.Contains(info.Pins, owner) {
			if err := b.store.Unpin(info.Digest, owner); err != nil {
				b.log.Warn("unpinning the base of a warm server gone", "pod", s.Pod, "blob", info.Digest, "err", err)
			}
		}
	}
}
