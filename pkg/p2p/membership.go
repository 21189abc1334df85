package p2p

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/content"
)

// NodeMeta is what a node tells the cluster about itself. It travels in
// memberlist's node metadata, encoded in at most 503 bytes; NewMembership and
// UpdateMeta reject values that would not fit.
type NodeMeta struct {
	// ChunkAddr is the host:port of the node's chunk server, at most 255
	// bytes; empty when it serves none.
	ChunkAddr string
	// Zone is the node's topology zone, at most 63 bytes.
	Zone string
	// FreeDisk is the space left in the node's cache, in bytes; not negative.
	FreeDisk int64
	// Version is the weightd version the node runs, at most 128 bytes.
	Version string
	// OriginFetches is how many blobs the node fetches from each limited
	// origin for the cluster now, by the origin's key: at most 8 origins,
	// each 1 to 64 blobs; key 0 counts the origins it does not name. The
	// nodes' parts of the origin limits are reckoned from them
	// (originlimit.go). SetOriginFetches sets it; UpdateMeta keeps it.
	OriginFetches map[OriginKey]int
}

// Peer is another live member of the cluster.
type Peer struct {
	// Name is the peer's unique member name.
	Name string
	// GossipAddr is the host:port the peer gossips on.
	GossipAddr string
	// Meta is the peer's metadata; zero if the peer sent metadata this
	// version cannot read.
	Meta NodeMeta
}

// MembershipConfig configures a Membership. Every field is optional.
// BindPort 0 picks a free port, which suits tests; a real cluster gossips on
// a fixed port, the one its seeds and JoinDNS records are reached on.
type MembershipConfig struct {
	// NodeName is the unique member name, 1 to 255 bytes; default: the
	// hostname.
	NodeName string
	// BindAddr and BindPort are where gossip listens, on TCP and UDP;
	// BindAddr defaults to all addresses.
	BindAddr string
	BindPort int
	// AdvertiseAddr (an IP) and AdvertisePort are what other members
	// contact, when that is not the bound address (NAT, several
	// interfaces). AdvertisePort defaults to BindPort.
	AdvertiseAddr string
	AdvertisePort int
	// Join lists "host:port" seeds to join the cluster through.
	Join []string
	// JoinDNS is a DNS name (a headless Service) whose A and AAAA records
	// are seeds, resolved again on every join attempt. The seeds' port is
	// the one in JoinDNS ("name:port"), else AdvertisePort, else BindPort.
	JoinDNS string
	// SecretKeys is the gossip keyring: 16, 24 or 32-byte AES keys, the
	// first one used to encrypt, all of them tried to decrypt. A node
	// without one of the keys can neither join nor read the gossip. Empty
	// means no encryption.
	SecretKeys [][]byte
	// Meta is what the node tells the cluster about itself at start.
	Meta NodeMeta
	// Fast selects short gossip, probe and push/pull intervals, for tests
	// and small LAN clusters.
	Fast bool
	// Logger receives the membership's log, and memberlist's own at debug
	// level; default: silent.
	Logger *slog.Logger
	// Transport, when set, carries the gossip instead of UDP and TCP sockets
	// on BindAddr and BindPort: memberlist.MockNetwork's in-process
	// transports in tests and measurements (bench/gossip). Nil: the network.
	Transport memberlist.NodeAwareTransport
	// Registerer, when set, gets weightd_p2p_peers,
	// weightd_p2p_gossip_messages_total{kind} and
	// weightd_p2p_gossip_dropped_total.
	Registerer prometheus.Registerer
}

// membershipTiming is what Fast changes besides memberlist's own intervals.
type membershipTiming struct {
	joinMinDelay, joinMaxDelay time.Duration // join retry backoff
	leaveTimeout               time.Duration // wait for the leave broadcast
	updateTimeout              time.Duration // wait for a meta update broadcast
	lookupTimeout              time.Duration // one JoinDNS lookup
}

// maxQueuedBroadcasts bounds the events waiting to be gossiped; the oldest
// are dropped beyond it (push/pull still carries their news).
const maxQueuedBroadcasts = 4096

// Membership is this node's view of the weightd cluster: who is alive, their
// metadata, and, through its Router, who holds which blob. It wraps
// hashicorp/memberlist (SWIM gossip) behind Run.
//
// Threading: every method is safe for concurrent use, before, during and
// after Run. Announce and UpdateMeta never block: they queue the change, and
// memberlist's goroutines gossip it (the metadata update on a goroutine Run
// owns). memberlist calls the delegate hooks (metadata, messages,
// broadcasts, push/pull state) from its packet and stream goroutines
// concurrently, and the join, leave and update hooks one at a time. The
// hooks never block: they hold Membership's or Router's mutex only to update
// a map, never while calling into memberlist, and they copy what they keep
// of the buffers memberlist hands them.
type Membership struct {
	cfg     MembershipConfig
	router  *Router
	log     *slog.Logger
	metrics *membershipMetrics
	keyring *memberlist.Keyring
	timing  membershipTiming
	dnsHost string // JoinDNS without its port
	dnsPort string
	// lookup resolves JoinDNS; tests replace it before Run.
	lookup func(ctx context.Context, host string) ([]string, error)

	broadcasts  *memberlist.TransmitLimitedQueue
	ready       chan struct{}
	metaChanged chan struct{} // holds one pending meta update
	started     atomic.Bool

	mu    sync.Mutex
	meta  []byte          // the encoded current NodeMeta
	peers map[string]Peer // live members but this node
	ml    *memberlist.Memberlist
}

// NewMembership validates cfg and returns a Membership that feeds router. It
// starts nothing; Run does.
func NewMembership(cfg MembershipConfig, router *Router) (*Membership, error) {
	if router == nil {
		return nil, fmt.Errorf("%w: nil router", content.ErrInvalid)
	}
	if cfg.NodeName == "" {
		host, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("naming the node after its host: %w", err)
		}
		cfg.NodeName = host
	}
	if err := validateName(cfg.NodeName); err != nil {
		return nil, err
	}
	if cfg.BindAddr == "" {
		cfg.BindAddr = "0.0.0.0"
	}
	if net.ParseIP(cfg.BindAddr) == nil {
		return nil, fmt.Errorf("%w: bind address %q is not an IP", content.ErrInvalid, cfg.BindAddr)
	}
	if cfg.AdvertiseAddr != "" && net.ParseIP(cfg.AdvertiseAddr) == nil {
		return nil, fmt.Errorf("%w: advertise address %q is not an IP", content.ErrInvalid, cfg.AdvertiseAddr)
	}
	if cfg.AdvertisePort != 0 && cfg.AdvertiseAddr == "" {
		return nil, fmt.Errorf("%w: advertise port %d without an advertise address", content.ErrInvalid, cfg.AdvertisePort)
	}
	for _, p := range []int{cfg.BindPort, cfg.AdvertisePort} {
		if p < 0 || p > 65535 {
			return nil, fmt.Errorf("%w: port %d", content.ErrInvalid, p)
		}
	}
	for _, seed := range cfg.Join {
		if _, _, err := net.SplitHostPort(seed); err != nil {
			return nil, fmt.Errorf("%w: join seed %q: %v", content.ErrInvalid, seed, err)
		}
	}
	m := &Membership{
		router:      router,
		log:         cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler)),
		ready:       make(chan struct{}),
		metaChanged: make(chan struct{}, 1),
		peers:       make(map[string]Peer),
		lookup:      net.DefaultResolver.LookupHost,
	}
	if cfg.JoinDNS != "" {
		var err error
		if m.dnsHost, m.dnsPort, err = splitJoinDNS(cfg); err != nil {
			return nil, err
		}
	}
	if len(cfg.SecretKeys) > 0 {
		for i, k := range cfg.SecretKeys {
			if err := memberlist.ValidateKey(k); err != nil {
				return nil, fmt.Errorf("%w: gossip key %d: %v", content.ErrInvalid, i, err)
			}
		}
		var err error
		if m.keyring, err = memberlist.NewKeyring(cfg.SecretKeys, cfg.SecretKeys[0]); err != nil {
			return nil, fmt.Errorf("%w: gossip keyring: %v", content.ErrInvalid, err)
		}
	}
	meta, err := encodeMeta(cfg.Meta)
	if err != nil {
		return nil, err
	}
	m.meta = meta
	cfg.Join = slices.Clone(cfg.Join)
	cfg.SecretKeys = nil // the keyring holds them
	m.cfg = cfg
	if cfg.Fast {
		m.timing = membershipTiming{joinMinDelay: 50 * time.Millisecond, joinMaxDelay: time.Second,
			leaveTimeout: time.Second, updateTimeout: time.Second, lookupTimeout: time.Second}
	} else {
		m.timing = membershipTiming{joinMinDelay: time.Second, joinMaxDelay: 30 * time.Second,
			leaveTimeout: 5 * time.Second, updateTimeout: 5 * time.Second, lookupTimeout: 5 * time.Second}
	}
	if m.metrics, err = newMembershipMetrics(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("registering p2p metrics: %w", err)
	}
	m.broadcasts = &memberlist.TransmitLimitedQueue{
		NumNodes:       m.numNodes,
		RetransmitMult: memberlist.DefaultLANConfig().RetransmitMult,
	}
	return m, nil
}

// splitJoinDNS returns JoinDNS's host and the seeds' port.
func splitJoinDNS(cfg MembershipConfig) (host, port string, err error) {
	if h, p, err := net.SplitHostPort(cfg.JoinDNS); err == nil {
		if n, err := strconv.Atoi(p); err != nil || n <= 0 || n > 65535 {
			return "", "", fmt.Errorf("%w: join DNS %q: bad port", content.ErrInvalid, cfg.JoinDNS)
		}
		return h, p, nil
	}
	n := cmp.Or(cfg.AdvertisePort, cfg.BindPort)
	if n == 0 {
		return "", "", fmt.Errorf("%w: join DNS %q has no port and BindPort is 0", content.ErrInvalid, cfg.JoinDNS)
	}
	return cfg.JoinDNS, strconv.Itoa(n), nil
}

// Run starts gossip, joins the cluster and serves until ctx is done, then
// leaves gracefully (telling the others, so they forget this node at once)
// and shuts down. It returns nil after a clean stop and an error if gossip
// cannot start; failing to join is not an error: Run keeps retrying, with
// backoff, while the node knows no other member, and serves as a lone node
// meanwhile. Run may be called once.
func (m *Membership) Run(ctx context.Context) error {
	if !m.started.CompareAndSwap(false, true) {
		return errors.New("membership: Run called twice")
	}
	addr := net.JoinHostPort(m.cfg.BindAddr, strconv.Itoa(m.cfg.BindPort))
	ml, err := memberlist.Create(m.memberlistConfig())
	if err != nil {
		return fmt.Errorf("starting gossip on %s: %w", addr, err)
	}
	m.mu.Lock()
	m.ml = ml
	m.mu.Unlock()
	close(m.ready)
	m.log.Info("gossip started", "node", m.cfg.NodeName, "addr", m.LocalAddr(), "encrypted", m.keyring != nil)

	var joining, updating sync.WaitGroup
	joining.Go(func() { m.joinLoop(ctx, ml) })
	updating.Go(func() { m.metaLoop(ctx, ml) })
	<-ctx.Done()
	joining.Wait() // a join in flight ends within memberlist's TCPTimeout
	if err := ml.Leave(m.timing.leaveTimeout); err != nil {
		m.log.Warn("leaving the cluster", "err", err)
	}
	err = ml.Shutdown()
	updating.Wait()
	m.mu.Lock()
	clear(m.peers)
	m.mu.Unlock()
	m.metrics.peers.Set(0)
	if err != nil {
		return fmt.Errorf("stopping gossip on %s: %w", addr, err)
	}
	m.log.Info("left the cluster", "node", m.cfg.NodeName)
	return nil
}

func (m *Membership) memberlistConfig() *memberlist.Config {
	c := memberlist.DefaultLANConfig()
	if m.cfg.Fast {
		c.GossipInterval = 50 * time.Millisecond
		c.ProbeInterval = 250 * time.Millisecond
		c.ProbeTimeout = 150 * time.Millisecond
		c.PushPullInterval = 500 * time.Millisecond
		c.TCPTimeout = 2 * time.Second
		c.SuspicionMult = 3
	}
	c.Name = m.cfg.NodeName
	c.BindAddr = m.cfg.BindAddr
	c.BindPort = m.cfg.BindPort
	c.AdvertiseAddr = m.cfg.AdvertiseAddr
	c.AdvertisePort = cmp.Or(m.cfg.AdvertisePort, m.cfg.BindPort)
	c.Transport = m.cfg.Transport // nil: memberlist binds BindAddr:BindPort
	c.Keyring = m.keyring
	c.Delegate = (*membershipDelegate)(m)
	c.Events = (*membershipEvents)(m)
	c.Logger = log.New(memberlistLogWriter{m.log}, "", 0)
	return c
}

// joinLoop joins the cluster through the seeds whenever the node knows no
// other member: at start, retrying with backoff, and later if it finds
// itself alone again (every member left, or a partition). It returns when
// ctx is done.
func (m *Membership) joinLoop(ctx context.Context, ml *memberlist.Memberlist) {
	if len(m.cfg.Join) == 0 && m.cfg.JoinDNS == "" {
		return
	}
	delay := m.timing.joinMinDelay
	for {
		wait := m.timing.joinMaxDelay
		if m.alone() {
			err := m.join(ctx, ml)
			switch {
			case ctx.Err() != nil:
				return
			case !m.alone():
				m.log.Info("joined the cluster", "peers", len(m.Members()))
				delay = m.timing.joinMinDelay
			case err != nil:
				m.log.Warn("joining the cluster", "err", err, "retry", delay)
				wait, delay = delay, min(2*delay, m.timing.joinMaxDelay)
			default:
				m.log.Debug("no other member to join yet", "retry", delay)
				wait, delay = delay, min(2*delay, m.timing.joinMaxDelay)
			}
		}
		// ±20% jitter keeps nodes that started together from retrying together.
		t := time.NewTimer(wait * time.Duration(80+rand.IntN(41)) / 100)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// join tries the seeds in random order until one of them lets the node in.
// It returns nil when there is no seed but this node.
func (m *Membership) join(ctx context.Context, ml *memberlist.Memberlist) error {
	seeds, lookupErr := m.seeds(ctx)
	var errs []error
	for _, seed := range seeds {
		if ctx.Err() != nil {
			return nil
		}
		if _, err := ml.Join([]string{seed}); err != nil {
			errs = append(errs, err)
			continue
		}
		return nil
	}
	if lookupErr != nil || len(errs) > 0 {
		return fmt.Errorf("joining %v: %w", seeds, errors.Join(append(errs, lookupErr)...))
	}
	return nil
}

// seeds returns the static seeds and JoinDNS's addresses, without this
// node's own address, shuffled. The error is the lookup's; the static seeds
// are returned even then.
func (m *Membership) seeds(ctx context.Context) ([]string, error) {
	seeds := slices.Clone(m.cfg.Join)
	var lookupErr error
	if m.dnsHost != "" {
		lctx, cancel := context.WithTimeout(ctx, m.timing.lookupTimeout)
		addrs, err := m.lookup(lctx, m.dnsHost)
		cancel()
		if err != nil {
			lookupErr = fmt.Errorf("resolving %s: %w", m.dnsHost, err)
		}
		for _, a := range addrs {
			seeds = append(seeds, net.JoinHostPort(a, m.dnsPort))
		}
	}
	self := m.LocalAddr()
	seeds = slices.DeleteFunc(seeds, func(s string) bool { return s == self })
	slices.Sort(seeds)
	seeds = slices.Compact(seeds)
	rand.Shuffle(len(seeds), func(i, j int) { seeds[i], seeds[j] = seeds[j], seeds[i] })
	return seeds, lookupErr
}

// metaLoop gossips metadata changes queued by UpdateMeta until ctx is done.
func (m *Membership) metaLoop(ctx context.Context, ml *memberlist.Memberlist) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.metaChanged:
			// UpdateNode waits until the update is gossiped or the timeout.
			if err := ml.UpdateNode(m.timing.updateTimeout); err != nil {
				m.log.Debug("gossiping node meta", "err", err)
			}
		}
	}
}

// Ready is closed once gossip is up: LocalAddr is known and the node
// accepts joins. It is never closed if Run fails to start gossip.
func (m *Membership) Ready() <-chan struct{} { return m.ready }

// LocalName returns this node's member name.
func (m *Membership) LocalName() string { return m.cfg.NodeName }

// LocalAddr returns the host:port this node gossips on, as other members
// see it; empty before Ready.
func (m *Membership) LocalAddr() string {
	m.mu.Lock()
	ml := m.ml
	m.mu.Unlock()
	if ml == nil {
		return ""
	}
	return ml.LocalNode().Address()
}

// Members returns the live members but this node, sorted by name.
func (m *Membership) Members() []Peer {
	m.mu.Lock()
	ps := make([]Peer, 0, len(m.peers))
	for _, p := range m.peers {
		ps = append(ps, p)
	}
	m.mu.Unlock()
	slices.SortFunc(ps, func(a, b Peer) int { return cmp.Compare(a.Name, b.Name) })
	return ps
}

// AmongFirst reports whether this node is among the first k of the live
// members, itself included, in rendezvous order of key: members with the
// same view agree on which k they are, and one that leaves moves the next
// in without reordering the others. Alone, a node is first.
func (m *Membership) AmongFirst(key string, k int) bool {
	names := []string{m.LocalName()}
	for _, p := range m.Members() {
		names = append(names, p.Name)
	}
	return slices.Contains(rendezvous(digest.Digest(key), names)[:min(k, len(names))], m.LocalName())
}

// Peer returns the live member called name, if this node knows one.
func (m *Membership) Peer(name string) (Peer, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p, ok := m.peers[name]
	return p, ok
}

// Announce records a change to this node's holdings in the Router and
// queues it for gossip; it never blocks. It fails only on an invalid kind or
// digest.
func (m *Membership) Announce(kind EventKind, d digest.Digest) error {
	h, err := m.router.setLocal(kind, d)
	if err != nil {
		return fmt.Errorf("announcing %v %s: %w", kind, d, err)
	}
	ev := holdingEvent{Node: m.cfg.NodeName, holding: h}
	msg, err := encodeEvent(ev)
	if err != nil {
		return fmt.Errorf("announcing %v %s: %w", kind, d, err)
	}
	m.queueBroadcast(ev, msg)
	return nil
}

// UpdateMeta changes what this node tells the cluster about itself, for
// example its free disk; it never blocks, the update is gossiped in the
// background. It fails, keeping the old metadata, if meta would not fit.
func (m *Membership) UpdateMeta(meta NodeMeta) error {
	return m.changeMeta(func(old NodeMeta) NodeMeta {
		meta.OriginFetches = old.OriginFetches
		return meta
	})
}

// SetOriginFetches sets NodeMeta.OriginFetches, the other fields as they
// are, and gossips it in the background.
func (m *Membership) SetOriginFetches(counts map[OriginKey]int) error {
	return m.changeMeta(func(meta NodeMeta) NodeMeta {
		meta.OriginFetches = counts
		return meta
	})
}

// changeMeta replaces this node's metadata with change of it.
func (m *Membership) changeMeta(change func(NodeMeta) NodeMeta) error {
	m.mu.Lock()
	old, err := decodeMeta(m.meta) // encoded here, so valid
	if err == nil {
		var b []byte
		if b, err = encodeMeta(change(old)); err == nil {
			m.meta = b
		}
	}
	m.mu.Unlock()
	if err != nil {
		return fmt.Errorf("updating node meta: %w", err)
	}
	select {
	case m.metaChanged <- struct{}{}:
	default: // an update is already pending; it will carry this meta
	}
	return nil
}

// alone reports whether the node knows no other live member.
func (m *Membership) alone() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.peers) == 0
}

// numNodes is the cluster size the broadcast queue scales retransmits by.
func (m *Membership) numNodes() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.peers) + 1
}

// queueBroadcast queues an encoded event for gossip, replacing any queued
// event about the same node and blob, and drops the oldest beyond
// maxQueuedBroadcasts.
func (m *Membership) queueBroadcast(ev holdingEvent, msg []byte) {
	m.broadcasts.QueueBroadcast(&membershipBroadcast{name: ev.Node + " " + string(ev.Digest), msg: msg})
	if n := m.broadcasts.NumQueued(); n > maxQueuedBroadcasts {
		m.broadcasts.Prune(maxQueuedBroadcasts)
		m.metrics.dropped.Add(float64(n - maxQueuedBroadcasts))
	}
}
