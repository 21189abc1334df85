package p2p

import (
	"log/slog"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/cache"
)

// NewDirectory is the swarm's view of the cluster: m's live members and
// r's record of who holds what.
func NewDirectory(m *Membership, r *Router) Directory { return clusterDirectory{m, r} }

type clusterDirectory struct {
	*Membership
	router *Router
}

func (c clusterDirectory) Holders(d digest.Digest) []Holder { return c.router.Holders(d) }

// Announcer returns a hook for cache.WithEvents that tells the cluster what
// the store holds: a download started (its chunks are servable as they are
// verified), a blob completed, a blob or download gone.
func Announcer(m *Membership, log *slog.Logger) func(cache.Event) {
	return func(e cache.Event) {
		var kind EventKind
		switch e.Kind {
		case cache.EventPartial:
			kind = EventPartial
		case cache.EventComplete:
			kind = EventComplete
		case cache.EventRemoved:
			kind = EventDropped
		default:
			return // chunks are learnt from chunk states, not gossip
		}
		if err := m.Announce(kind, e.Digest); err != nil {
			log.Warn("announcing a holding", "digest", e.Digest, "err", err)
		}
	}
}
