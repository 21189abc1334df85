package p2p

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

// Resolutions remembers how references resolved to models (name, revision,
// files with digests), so that a peer can still resolve a reference when its
// origin cannot be reached. It keeps the most recent max entries and is safe
// for concurrent use.
type Resolutions struct {
	max int

	mu    sync.Mutex
	m     map[string]content.Model // by resolutionKey
	order []string                 // oldest first
}

// NewResolutions returns an empty memory of at most max resolutions.
func NewResolutions(max int) *Resolutions {
	return &Resolutions{max: max, m: make(map[string]content.Model)}
}

// Put records that ref resolved to m.
func (r *Resolutions) Put(ref string, m content.Model) {
	k := resolutionKey(ref)
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.m[k]; !ok {
		r.order = append(r.order, k)
	}
	r.m[k] = m
	for len(r.order) > r.max {
		delete(r.m, r.order[0])
		r.order = r.order[1:]
	}
}

// Get returns what ref resolved to, if it is remembered.
func (r *Resolutions) Get(ref string) (content.Model, bool) {
	return r.get(resolutionKey(ref))
}

func (r *Resolutions) get(key string) (content.Model, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	m, ok := r.m[key]
	return m, ok
}

// resolutionKey names a reference on the wire without revealing it (a
// presigned URL's query is a credential).
func resolutionKey(ref string) string {
	sum := sha256.Sum256([]byte(ref))
	return hex.EncodeToString(sum[:])
}

// ResolverOrder is the order in which members are chosen to resolve ref
// for the cluster: the first live one resolves it. Exported for the attack
// tests, whose attacker picks a name that ranks first.
func ResolverOrder(ref string, names []string) []string {
	return rendezvous(digest.Digest(resolutionKey(ref)), names)
}

// maxResolutionSize bounds a peer's answer.
const maxResolutionSize = 16 << 20

// ResolveFromPeers asks the live peers, one after the other, how ref
// resolved, and returns the first answer that is a valid model and that
// accept approves (for a digest-pinned reference: it names that digest).
// Peers are members authenticated by the gossip key; the blobs themselves
// are still verified against their digests.
func (s *Swarm) ResolveFromPeers(ctx context.Context, ref string, accept func(content.Model) error) (content.Model, error) {
	key := resolutionKey(ref)
	var errs []error
	for _, p := range s.dir.Members() {
		if p.Meta.ChunkAddr == "" || s.Banned(p.Name) {
			continue
		}
		m, err := s.askResolution(ctx, p.Meta.ChunkAddr, key)
		if err == nil {
			if err = m.Validate(); err == nil {
				err = accept(m)
			}
		}
		if err == nil {
			s.log.Info("resolved from a peer", "peer", p.Name, "model", m.Name, "revision", m.Revision)
			return m, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", p.Name, err))
	}
	if len(errs) == 0 {
		return content.Model{}, errors.New("no peer to ask")
	}
	return content.Model{}, errors.Join(errs...)
}

// SharedResolveWait is how long SharedResolve waits for the peer chosen to
// resolve a reference before it asks the origin itself.
const SharedResolveWait = 15 * time.Second

// SharedResolve resolves a pinned reference once for the cluster: the live
// member first in rendezvous order for ref calls resolve (it asks the
// origin; the caller then Puts the result in the Resolutions its chunk
// server serves), and every other node polls that member for its answer, so
// that N nodes resolving the same model at once ask the origin about once.
// A node resolves from the origin itself when the chosen member leaves,
// answers with a model that is invalid or that accept rejects, or has no
// answer after SharedResolveWait.
func (s *Swarm) SharedResolve(ctx context.Context, ref string, resolve func(context.Context) (content.Model, error),
	accept func(content.Model) error,
) (content.Model, error) {
	key := resolutionKey(ref)
	deadline := time.Now().Add(SharedResolveWait)
	for poll := 0; time.Now().Before(deadline); poll++ {
		peer, ok := s.resolver(key)
		if !ok {
			break // this node is first
		}
		m, err := s.askResolution(ctx, peer.Meta.ChunkAddr, key)
		if err == nil {
			if err = m.Validate(); err == nil {
				err = accept(m)
			}
			if err == nil {
				s.log.Info("resolved by a peer", "peer", peer.Name, "model", m.Name, "revision", m.Revision, "polls", poll+1)
				return m, nil
			}
			s.log.Warn("a peer's resolution is unusable; asking the origin", "peer", peer.Name, "err", err)
			break
		}
		t := time.NewTimer(200 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return content.Model{}, ctx.Err()
		case <-t.C:
		}
	}
	return resolve(ctx)
}

// resolver is the live member that resolves key for the cluster, or false
// when it is this node.
func (s *Swarm) resolver(key string) (Peer, bool) {
	names := []string{s.dir.LocalName()}
	peers := make(map[string]Peer)
	for _, p := range s.dir.Members() {
		if p.Meta.ChunkAddr != "" && !s.Banned(p.Name) {
			names = append(names, p.Name)
			peers[p.Name] = p
		}
	}
	first := rendezvous(digest.Digest(key), names)[0]
	p, ok := peers[first]
	return p, ok
}

func (s *Swarm) askResolution(ctx context.Context, addr, key string) (content.Model, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b, err := s.getSmall(ctx, s.peerURL(addr, resolutionPrefix+key), maxResolutionSize)
	if err != nil {
		return content.Model{}, fmt.Errorf("resolution: %w", err)
	}
	var m content.Model
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return content.Model{}, fmt.Errorf("resolution: %w", err)
	}
	return m, nil
}

// resolutionPrefix is the chunk server's route for resolutions.
const resolutionPrefix = "/v1/resolutions/"

func (s *ChunkServer) serveResolution(w http.ResponseWriter, r *http.Request) {
	key := r.PathValue("key")
	if len(key) != 64 {
		s.fail(w, "resolution", http.StatusBadRequest, errors.New("resolution key: want 64 hex digits"))
		return
	}
	m, ok := s.resolutions.get(key)
	if !ok {
		s.fail(w, "resolution", http.StatusNotFound, errors.New("resolution not known"))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(m); err != nil {
		s.log.Debug("sending a resolution", "err", err)
		return
	}
	s.m.requests.WithLabelValues("resolution", "200").Inc()
}
