package agent

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/p2p"
	"github.com/weightd/weightd/pkg/peertls"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
)

// P2PConfig is the peer-to-peer part of the agent's configuration.
type P2PConfig struct {
	GossipAddr     string                   `help:"Gossip (memberlist) listen address, host:port; empty disables sharing with peers." default:":7946" env:"WEIGHTD_GOSSIP_ADDR"`
	AdvertiseAddr  string                   `help:"IP that peers reach this node at, when not the listen address." env:"WEIGHTD_ADVERTISE_ADDR"`
	Join           []string                 `help:"Peers to join through, host:port, comma-separated." env:"WEIGHTD_JOIN" sep:","`
	JoinDNS        string                   `help:"DNS name whose A/AAAA records are peers to join (a headless Service), name[:port]." env:"WEIGHTD_JOIN_DNS"`
	GossipKeyFile  string                   `help:"File of gossip encryption keys, base64, one per line, the first used to encrypt; without it gossip is not encrypted." env:"WEIGHTD_GOSSIP_KEY_FILE"`
	NodeName       string                   `help:"Member name, unique in the cluster (default: the hostname)." env:"WEIGHTD_NODE_NAME"`
	Zone           string                   `help:"Topology zone of this node, told to peers: the swarm asks peers of its zone first, and a blob enters each zone about once." env:"WEIGHTD_ZONE"`
	ChunkAddr      string                   `help:"Chunk server listen address, host:port: peers download verified chunks from it." default:":7947" env:"WEIGHTD_CHUNK_ADDR"`
	UploadLimit    bytesize.Size            `help:"Most bytes per second served to peers; 0 for no limit." default:"0" env:"WEIGHTD_UPLOAD_LIMIT"`
	DownloadLimit  bytesize.Size            `help:"Most bytes per second downloaded from peers and the origin, all together; 0 for no limit." default:"0" env:"WEIGHTD_DOWNLOAD_LIMIT"`
	OriginLimit    bytesize.Size            `help:"Most bytes per second each origin sends the whole cluster, the same on every node: the nodes fetching from it each take a part (by the blobs and fetchers they see); 0 for no limit." default:"0" env:"WEIGHTD_ORIGIN_LIMIT"`
	OriginLimits   map[string]bytesize.Size `help:"Per-origin overrides of --origin-limit, origin=bytes/s, comma-separated: an OCI registry by its host (with its port), hf for the model hub, s3 for the object store, an http(s) origin by its host; 0 for no limit." mapsep:"," env:"WEIGHTD_ORIGIN_LIMITS"`
	OriginFetchers int                      `help:"Nodes that fetch one blob from its origin for the whole cluster, each a share of its chunks." default:"2" env:"WEIGHTD_ORIGIN_FETCHERS"`
	MaxUploads     int                      `help:"Chunk uploads served at once; more requests are sent to other peers. An upload to a slow reader lends its slot, up to twice as many in all." default:"6" env:"WEIGHTD_MAX_UPLOADS"`
	MaxPeerUploads int                      `help:"Chunk uploads served at once to one peer address, so that slow or hostile clients cannot hold them all; 0 for half of --max-uploads, rounded up." default:"0" env:"WEIGHTD_MAX_PEER_UPLOADS"`
	UploadTCP      string                   `help:"TCP congestion control of uploads to peers (cubic shares switch ports among many flows; BBRv1 floods them); empty for the node's default." default:"cubic" env:"WEIGHTD_UPLOAD_TCP"`
	FastGossip     bool                     `help:"Short gossip intervals, for small clusters on one LAN and tests." env:"WEIGHTD_FAST_GOSSIP"`
	// The chunk server serves any cached blob to whoever asks by digest:
	// without mutual TLS, anything that reaches the node.
	PeerCAFile       string        `name:"peer-ca-file" help:"PEM bundle of the cluster CA certificates peers must hold a certificate of (several while a CA is rotated); with --peer-ca-key-file, peers talk mutual TLS on the chunk address." env:"WEIGHTD_PEER_CA_FILE"`
	PeerCAKeyFile    string        `name:"peer-ca-key-file" help:"PEM key of the cluster CA that signs this agent's own certificate, minted for --node-name at start and renewed before it expires." env:"WEIGHTD_PEER_CA_KEY_FILE"`
	PeerCertLifetime time.Duration `name:"peer-cert-lifetime" help:"How long each minted peer certificate is valid; it is renewed at two thirds." default:"24h" env:"WEIGHTD_PEER_CERT_LIFETIME"`
	PeerInsecure     bool          `name:"peer-insecure" help:"Share with peers over plain HTTP, without the cluster CA: anything that reaches the chunk address can read every cached blob and resolution. For a lab only." env:"WEIGHTD_PEER_INSECURE"`
}

// peerIdentity is the agent's TLS identity among its peers, or nil when
// it shares over plain HTTP (--peer-insecure); an error when it has
// neither the CA nor leave to go without.
func peerIdentity(cfg P2PConfig, nodeName string, log *slog.Logger) (*peertls.Identity, error) {
	switch {
	case cfg.PeerInsecure && (cfg.PeerCAFile != "" || cfg.PeerCAKeyFile != ""):
		return nil, errors.New("--peer-insecure and --peer-ca-file/--peer-ca-key-file: choose one")
	case cfg.PeerInsecure:
		log.Warn("sharing with peers over plain HTTP (--peer-insecure): anything that reaches the chunk address reads every cached blob", "chunk_addr", cfg.ChunkAddr)
		return nil, nil
	case cfg.PeerCAFile == "" && cfg.PeerCAKeyFile == "":
		return nil, errors.New("sharing with peers needs the cluster CA (--peer-ca-file and --peer-ca-key-file), so that only this cluster's agents read the cache from the chunk address; " +
			"pass --peer-insecure to serve it to anything that reaches the node, or --gossip-addr= to share nothing")
	case cfg.PeerCAFile == "" || cfg.PeerCAKeyFile == "":
		return nil, errors.New("peer TLS needs both --peer-ca-file and --peer-ca-key-file")
	}
	id, err := peertls.New(nodeName, peertls.Files{CA: cfg.PeerCAFile, Key: cfg.PeerCAKeyFile},
		peertls.WithLifetime(cfg.PeerCertLifetime), peertls.WithLogger(log))
	if err != nil {
		return nil, err
	}
	log.Info("peers talk mutual TLS", "node", nodeName, "ca", id.Certificate().Issuer.CommonName, "expires", id.Certificate().NotAfter)
	return id, nil
}

// peering is the agent's peer-to-peer side: membership, content routing,
// the chunk server and the swarm downloader.
type peering struct {
	membership  *p2p.Membership
	router      *p2p.Router
	swarm       *p2p.Swarm
	resolutions *p2p.Resolutions
	server      *p2p.ChunkServer
	identity    *peertls.Identity // nil: plain HTTP between peers
	chunkLn     net.Listener
	chunkHost   bool // the chunk address names a host; else the gossip address's is used
}

// newPeering builds the peer-to-peer side, or returns nil when gossip is
// disabled. It opens the chunk server's listener and starts nothing.
func newPeering(cfg P2PConfig, version string, log *slog.Logger, reg prometheus.Registerer) (*peering, error) {
	if cfg.GossipAddr == "" {
		return nil, nil
	}
	host, portStr, err := net.SplitHostPort(cfg.GossipAddr)
	if err != nil {
		return nil, fmt.Errorf("--gossip-addr %q: %w", cfg.GossipAddr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return nil, fmt.Errorf("--gossip-addr %q: bad port", cfg.GossipAddr)
	}
	keys, err := readGossipKeys(cfg.GossipKeyFile)
	if err != nil {
		return nil, err
	}
	ln, err := p2p.ListenChunks(context.Background(), cfg.ChunkAddr, cfg.UploadTCP, log)
	if err != nil {
		return nil, fmt.Errorf("listening for the chunk server: %w", err)
	}
	p := &peering{router: p2p.NewRouter(0), resolutions: p2p.NewResolutions(4096), chunkLn: ln}
	chunkHost, _, _ := net.SplitHostPort(cfg.ChunkAddr)
	p.chunkHost = chunkHost != "" && !net.ParseIP(chunkHost).IsUnspecified()
	meta := p2p.NodeMeta{Zone: cfg.Zone, Version: version}
	if p.chunkHost {
		meta.ChunkAddr = ln.Addr().String()
	}
	p.membership, err = p2p.NewMembership(p2p.MembershipConfig{
		NodeName: cfg.NodeName, BindAddr: host, BindPort: port, AdvertiseAddr: cfg.AdvertiseAddr,
		Join: cfg.Join, JoinDNS: cfg.JoinDNS, SecretKeys: keys, Meta: meta, Fast: cfg.FastGossip,
		Logger: log.With("component", "membership"), Registerer: reg,
	}, p.router)
	if err != nil {
		ln.Close()
		return nil, err
	}
	if p.identity, err = peerIdentity(cfg, p.membership.LocalName(), log.With("component", "peertls")); err != nil {
		ln.Close()
		return nil, err
	}
	swarmCfg := p2p.SwarmConfig{OriginFetchers: cfg.OriginFetchers, DownloadLimit: int64(cfg.DownloadLimit),
		OriginLimit: int64(cfg.OriginLimit), OriginLimits: originLimits(cfg.OriginLimits), Zone: cfg.Zone}
	if p.identity != nil {
		swarmCfg.TLS = p.identity.ClientConfig()
	}
	if cfg.FastGossip {
		swarmCfg.Settle = 300 * time.Millisecond // gossip reaches everyone well within it
	}
	membership := p.membership
	swarmCfg.PublishOriginFetches = func(counts map[p2p.OriginKey]int) {
		if err := membership.SetOriginFetches(counts); err != nil {
			log.Warn("gossiping this node's origin fetches", "err", err)
		}
	}
	p.swarm, err = p2p.NewSwarm(p2p.NewDirectory(p.membership, p.router), nil, swarmCfg, log.With("component", "swarm"), reg)
	if err != nil {
		ln.Close()
		return nil, err
	}
	return p, nil
}

// serve starts the chunk server on the store and keeps the membership up
// until ctx ends. Once gossip is up, a chunk address without a host is
// advertised on the gossip address's host.
func (p *peering) serve(store *cache.Store, cfg P2PConfig, version string, log *slog.Logger, reg prometheus.Registerer) (run []func(context.Context) error, err error) {
	opts := []p2p.ServerOption{
		p2p.WithSwarm(p.swarm),
		p2p.WithUploadLimit(int64(cfg.UploadLimit)),
		p2p.WithMaxUploads(cfg.MaxUploads),
		p2p.WithMaxUploadsPerPeer(cfg.MaxPeerUploads),
		p2p.WithResolutions(p.resolutions),
		p2p.WithServerLogger(log.With("component", "chunkserver")),
	}
	renew := func(context.Context) error { return nil }
	if p.identity != nil {
		opts = append(opts, p2p.WithTLS(p.identity.ServerConfig()))
		renew = p.identity.Run
	}
	if p.server, err = p2p.NewChunkServer(store, reg, opts...); err != nil {
		return nil, err
	}
	return []func(context.Context) error{
		p.membership.Run,
		renew,
		func(ctx context.Context) error { return p.server.Run(ctx, p.chunkLn) },
		func(ctx context.Context) error {
			if p.chunkHost {
				return nil
			}
			select {
			case <-p.membership.Ready():
			case <-ctx.Done():
				return nil
			}
			host, _, err := net.SplitHostPort(p.membership.LocalAddr())
			if err != nil {
				return err
			}
			_, port, _ := net.SplitHostPort(p.chunkLn.Addr().String())
			return p.membership.UpdateMeta(p2p.NodeMeta{ChunkAddr: net.JoinHostPort(host, port), Zone: cfg.Zone, Version: version})
		},
	}, nil
}

// originLimits is --origin-limits in bytes per second, by origin name
// (ref.Ref.Origin: lower-cased, Docker Hub's aliases folded, as it is).
func originLimits(limits map[string]bytesize.Size) map[string]int64 {
	out := make(map[string]int64, len(limits))
	for name, limit := range limits {
		out[ref.CanonicalRegistry(name)] = int64(limit)
	}
	return out
}

// list is the live peers, for the API's status.
func (p *peering) list() []api.Peer {
	var out []api.Peer
	for _, m := range p.membership.Members() {
		out = append(out, api.Peer{Name: m.Name, ChunkAddr: m.Meta.ChunkAddr, Zone: m.Meta.Zone})
	}
	return out
}

// source routes every blob the inner source resolves through the swarm,
// and resolves through peers when the origin cannot be reached.
func (p *peering) source(inner source.Source, log *slog.Logger) source.Source {
	return p2p.NewSwarmSource(inner, p.swarm, p.resolutions, p.membership, log)
}

// blobSource routes a blob the registry mirror misses through the swarm
// when there are peers to share it with, else streams it from upstream
// within the download limit. The mirror names the registry as
// ref.Ref.Origin does (ref.CanonicalRegistry).
func (p *peering) blobSource(desc content.Descriptor, registry string, upstream content.RangeOpener) content.RangeOpener {
	origin := p2p.Origin{Name: registry, RangeOpener: upstream}
	if len(p.membership.Members()) == 0 {
		return p.swarm.Paced(origin)
	}
	return p.swarm.Source(desc, origin)
}

// sharedResolve resolves a pinned reference once for the cluster (see
// p2p.Swarm.SharedResolve) and remembers the answer for the peers that ask.
// accept, the source's, checks a peer's answer.
func (p *peering) sharedResolve(ctx context.Context, pinned ref.Ref, resolve func(context.Context) (content.Model, error),
	accept func(content.Model) error,
) (content.Model, error) {
	key := pinned.String()
	own := func(ctx context.Context) (content.Model, error) {
		m, err := resolve(ctx)
		if err == nil {
			p.resolutions.Put(key, m)
		}
		return m, err
	}
	if len(p.membership.Members()) == 0 {
		return own(ctx)
	}
	return p.swarm.SharedResolve(ctx, key, own, accept)
}

// readGossipKeys reads base64 keys, one per line; blank lines and lines
// starting with # are skipped.
func readGossipKeys(path string) ([][]byte, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading gossip keys: %w", err)
	}
	var keys [][]byte
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, err := base64.StdEncoding.DecodeString(line)
		if err != nil {
			return nil, fmt.Errorf("gossip key file %s, line %d: not base64", path, i+1)
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("gossip key file %s holds no key", path)
	}
	return keys, nil
}
