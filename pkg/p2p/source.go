package p2p

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"

	"github.com/weightd/weightd/pkg/source"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

// NewSwarmSource routes every blob inner resolves through swarm, once
// membership has peers to share with, and resolves through peers when the
// origin cannot be reached. resolutions remembers what resolved here, for
// peers that ask and for a later origin outage.
func NewSwarmSource(inner source.Source, swarm *Swarm, resolutions *Resolutions, membership *Membership, log *slog.Logger) source.Source {
	return throughSwarmSource{inner: inner, swarm: swarm, resolutions: resolutions, membership: membership, log: log}
}

type throughSwarmSource struct {
	inner       source.Source
	swarm       *Swarm
	resolutions *Resolutions
	membership  *Membership
	log         *slog.Logger
}

func (s throughSwarmSource) Resolve(ctx context.Context, r ref.Ref) (*source.Resolution, error) {
	res, err := s.inner.Resolve(ctx, r)
	switch {
	case err == nil && res.Verify == nil && res.Image == nil && len(res.Packed) == 0:
		// Remembered, to serve peers and to resolve it again while the
		// origin is down: a verified model that is just its files.
		s.resolutions.Put(r.String(), res.Model)
	case err == nil:
		// Not remembered: not verified yet (a peer's listing), or more
		// than its files (an image, packed layers).
	default:
		if res, err = s.resolveFromPeers(ctx, r, err); err != nil {
			return nil, err
		}
	}
	if len(s.membership.Members()) == 0 {
		// No peer to share with: stream from the origin, the fastest path for
		// one node, within its download limit. Its chunks are still served
		// as they are verified, so peers that join meanwhile can take them.
		throughSwarm(res, r.Origin(), func(_ content.Descriptor, origin Origin) content.RangeOpener {
			return s.swarm.Paced(origin)
		})
		return res, nil
	}
	throughSwarm(res, r.Origin(), s.swarm.Source)
	return res, nil
}

// throughSwarm routes every blob of res, from the origin called origin,
// through wrap: a model's files, its packed layers and an image's blobs
// alike.
func throughSwarm(res *source.Resolution, origin string, wrap func(content.Descriptor, Origin) content.RangeOpener) {
	descs := make([]content.Descriptor, 0, len(res.Blobs))
	for _, f := range res.Model.Files {
		descs = append(descs, f.Descriptor)
	}
	for _, l := range res.Packed {
		descs = append(descs, l.Descriptor)
	}
	if res.Image != nil {
		for _, b := range res.Image.Blobs {
			descs = append(descs, b.Descriptor)
		}
	}
	wrapped := make(map[digest.Digest]bool, len(res.Blobs))
	for _, d := range descs {
		if op, ok := res.Blobs[d.Digest]; ok && !wrapped[d.Digest] {
			res.Blobs[d.Digest] = wrap(d, Origin{Name: origin, RangeOpener: op})
			wrapped[d.Digest] = true
		}
	}
}

// resolveFromPeers is the fallback when the origin fails to resolve r:
// what this node itself resolved r to before, or, for a file pinned by
// digest, what a peer says (prefetch.CheckWithoutOrigin). Any other
// reference fails: a peer's file list for it is unverifiable without the
// origin. The blobs can then come only from peers.
func (s throughSwarmSource) resolveFromPeers(ctx context.Context, r ref.Ref, originErr error) (*source.Resolution, error) {
	if errors.Is(originErr, content.ErrPermanent) {
		return nil, originErr // the origin answered: the reference is wrong
	}
	m, ok := s.resolutions.Get(r.String())
	if !ok {
		if err := prefetch.NeedsOrigin(r); err != nil {
			return nil, fmt.Errorf("%w (and it was not resolved here before: %v)", originErr, err)
		}
		var err error
		m, err = s.swarm.ResolveFromPeers(ctx, r.String(), func(m content.Model) error { return prefetch.CheckWithoutOrigin(r, m) })
		if err != nil {
			return nil, fmt.Errorf("%w (and no peer could resolve it: %v)", originErr, err)
		}
	}
	s.log.Warn("origin unreachable; resolved as before or through a peer, fetching from peers only", "ref", r.Redacted(), "err", originErr)
	res := &source.Resolution{Model: m, Blobs: make(map[digest.Digest]content.RangeOpener, len(m.Files))}
	for _, f := range m.Files {
		res.Blobs[f.Digest] = unreachable{originErr}
	}
	return res, nil
}

// unreachable is the origin of a blob whose origin cannot be reached.
type unreachable struct{ err error }

func (u unreachable) OpenRange(context.Context, int64) (io.ReadCloser, error) { return nil, u.err }
