package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/platforms"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/mirror"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	"github.com/weightd/weightd/pkg/source/dialguard"
	"github.com/weightd/weightd/pkg/source/hf"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/source/oci"
	"github.com/weightd/weightd/pkg/source/s3"
)

// SourcesConfig says where references are resolved and with which
// credentials.
type SourcesConfig struct {
	HFEndpoint         string   `name:"hf-endpoint" help:"Hugging Face style hub that hf:// references resolve on (a mirror or private hub)." default:"https://huggingface.co" env:"HF_ENDPOINT"`
	HFTokenFile        string   `name:"hf-token-file" help:"File holding the hub token; without it the HF_TOKEN environment variable is used, if set." env:"WEIGHTD_HF_TOKEN_FILE"`
	DockerConfig       string   `help:"Docker config.json with registry credentials for oci:// references and the mirror." env:"WEIGHTD_DOCKER_CONFIG"`
	AgentCredentials   []string `name:"agent-credentials" help:"Who besides the operator (CLI, local API, PrefetchPolicies) may have the agent's own credentials (hub token, Docker config, AWS credentials) used for them: HOST=NAMESPACE[;NAMESPACE…] per registry or hub host, or s3://BUCKET per bucket, comma-separated; * as a namespace is every pod, the mirror's clients included. Default: the operator only." env:"WEIGHTD_AGENT_CREDENTIALS" sep:","`
	InsecureRegistries []string `help:"Registries spoken to over plain HTTP, host[:port], comma-separated (loopback ones always may)." env:"WEIGHTD_INSECURE_REGISTRIES" sep:","`
	Platform           string   `help:"Platform whose image is picked from multi-platform indexes, os/arch[/variant] (default: this node's)." env:"WEIGHTD_PLATFORM"`
	S3Endpoint         string   `name:"s3-endpoint" help:"Endpoint of the S3-compatible store s3:// references resolve on (MinIO, Ceph RGW, R2, GCS interop), http(s)://host[:port]; empty: AWS S3." env:"WEIGHTD_S3_ENDPOINT"`
	S3Region           string   `name:"s3-region" help:"Region S3 requests are signed for; empty: the AWS configuration's (AWS_REGION), else us-east-1." env:"WEIGHTD_S3_REGION"`
	S3PathStyle        bool     `name:"s3-path-style" help:"Address S3 buckets in the path (host/bucket/key) instead of the host name (bucket.host/key), as most self-hosted stores need." env:"WEIGHTD_S3_PATH_STYLE"`
	S3AllowIMDS        bool     `name:"s3-allow-imds" help:"Let the agent's S3 credentials come from the instance metadata service (the node's instance role). Off by default: pods name the references, and would get what the node's role may read. Environment, shared config, IRSA web identity and EKS Pod Identity are always used." env:"WEIGHTD_S3_ALLOW_IMDS"`
	FetchAllowCIDRs    []string `name:"fetch-allow-cidrs" help:"CIDRs or addresses that references may make the agent fetch from although they are loopback, link-local, cloud metadata or this node's own addresses (refused by default), comma-separated." env:"WEIGHTD_FETCH_ALLOW_CIDRS" sep:","`
}

// ImportConfig says which containerd prefetched images go into.
type ImportConfig struct {
	ContainerdAddress   string `help:"containerd socket that prefetched images are imported into; empty: images stay in the cache (and the mirror serves them)." env:"WEIGHTD_CONTAINERD_ADDRESS"`
	ContainerdNamespace string `help:"containerd namespace of imported images; the kubelet's is k8s.io." default:"k8s.io" env:"WEIGHTD_CONTAINERD_NAMESPACE"`
	Snapshotter         string `help:"Snapshotter imported images are unpacked for (the kubelet's)." default:"overlayfs" env:"WEIGHTD_SNAPSHOTTER"`
	// ContainerdContentRoot is containerd.Config.ContentRoot.
	ContainerdContentRoot string `help:"containerd's content store directory as this process sees it (<containerd root>/io.containerd.content.v1.content): cached blobs are hard-linked into it instead of copied over gRPC where it is in the cache's mount; empty: ask containerd (its path must then be the same here); none: always copy." env:"WEIGHTD_CONTAINERD_CONTENT_ROOT"`
}

// MirrorConfig is the node's registry mirror.
type MirrorConfig struct {
	MirrorAddr       string   `help:"Listen address of the registry mirror, host:port (e.g. 127.0.0.1:5001); empty disables it." env:"WEIGHTD_MIRROR_ADDR"`
	MirrorRegistries []string `help:"Registries the mirror serves, host[:port] (docker.io for Docker Hub), comma-separated." env:"WEIGHTD_MIRROR_REGISTRIES" sep:","`
	HostsDir         string   `help:"containerd's registry config_path (e.g. /etc/containerd/certs.d): hosts.toml files pointing the mirrored registries at the mirror are written there at start." env:"WEIGHTD_HOSTS_DIR" type:"path"`
}

// sources builds the origin sources: HTTP(S), OCI registries and the hub.
// The OCI source is also the mirror's upstream. shared, when not nil,
// resolves hub listings once for the cluster. Every connection goes through
// one dialguard.Guard: pods name the references, so they must not reach the
// node's own services or the cloud metadata service through the agent; the
// hub endpoint and the mirrored registries are the operator's choice and
// are trusted wherever they are. Credentials sent over plain HTTP are
// logged (see plainCredentials).
func (c SourcesConfig) sources(shared hf.SharedResolver, mirrored []string, version string, log *slog.Logger) (source.Sources, *oci.Source, error) {
	allow, err := dialguard.ParseAllowList(c.FetchAllowCIDRs)
	if err != nil {
		return nil, nil, fmt.Errorf("--fetch-allow-cidrs: %w", err)
	}
	creds, err := source.ParseAgentCredentials(c.AgentCredentials)
	if err != nil {
		return nil, nil, fmt.Errorf("--agent-credentials: %w", err)
	}
	trusted := slices.Clone(mirrored)
	if c.HFEndpoint != "" {
		u, err := url.Parse(c.HFEndpoint)
		if err != nil {
			return nil, nil, fmt.Errorf("--hf-endpoint %q: %w", c.HFEndpoint, err)
		}
		trusted = append(trusted, u.Host)
	}
	if c.S3Endpoint != "" {
		u, err := url.Parse(c.S3Endpoint)
		if err != nil {
			return nil, nil, fmt.Errorf("--s3-endpoint %q: %w", c.S3Endpoint, err)
		}
		trusted = append(trusted, u.Host)
	}
	guard := dialguard.New(allow, trusted...)
	transport := &plainCredentials{base: guard.Transport(), log: log, warned: new(sync.Map)}
	client := &http.Client{Transport: transport}

	ociOpts := []oci.Option{
		oci.WithVersion(version), oci.WithInsecureRegistries(c.InsecureRegistries...),
		// Registries' short requests keep connections of their own (oci/lanes.go).
		oci.WithTransport(transport), oci.WithShortTransport(&plainCredentials{base: guard.Transport(), log: log, warned: transport.warned}),
		oci.WithAgentCredentials(creds),
	}
	if c.DockerConfig != "" {
		ociOpts = append(ociOpts, oci.WithDockerConfig(c.DockerConfig))
	}
	if c.Platform != "" {
		p, err := platforms.Parse(c.Platform)
		if err != nil {
			return nil, nil, fmt.Errorf("--platform %q: %w", c.Platform, err)
		}
		ociOpts = append(ociOpts, oci.WithPlatform(oci.Platform{OS: p.OS, Architecture: p.Architecture, Variant: p.Variant}))
	}
	ociSrc := oci.New(ociOpts...)

	token := os.Getenv("HF_TOKEN")
	if c.HFTokenFile != "" {
		b, err := os.ReadFile(c.HFTokenFile)
		if err != nil {
			return nil, nil, fmt.Errorf("reading the hub token: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	hfOpts := []hf.Option{hf.WithVersion(version), hf.WithAgentCredentials(creds)}
	if c.HFEndpoint != "" {
		hfOpts = append(hfOpts, hf.WithEndpoint(c.HFEndpoint))
	}
	if token != "" {
		hfOpts = append(hfOpts, hf.WithToken(token))
	}
	if shared != nil {
		hfOpts = append(hfOpts, hf.WithShared(shared))
	}
	hfSrc, err := hf.New(client, hfOpts...)
	if err != nil {
		return nil, nil, err
	}
	s3Src, err := c.s3Source(client, creds, log)
	if err != nil {
		return nil, nil, err
	}
	return source.Sources{
		ref.KindHTTP: httpsource.New(client, httpsource.WithVersion(version)),
		ref.KindOCI:  ociSrc,
		ref.KindHF:   hfSrc,
		ref.KindS3:   s3Src,
	}, ociSrc, nil
}

// s3Source builds the S3 source with the AWS SDK's default credential
// chain, IMDS only where --s3-allow-imds says. Credentials are tried once
// here: an agent with none (most clusters without AWS) fetches anonymously
// rather than failing every s3:// reference, public buckets included.
func (c SourcesConfig) s3Source(client *http.Client, rules source.AgentCredentials, log *slog.Logger) (*s3.Source, error) {
	// New has no context: it starts nothing that outlives it, and the
	// look-up is bounded.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	opts := []s3.Option{s3.WithAgentCredentials(rules), s3.WithPathStyle(c.S3PathStyle)}
	creds, region, err := s3.LoadCredentials(ctx, c.S3AllowIMDS)
	if err != nil {
		return nil, err
	}
	if _, err := creds.Retrieve(ctx); err != nil {
		log.Info("no AWS credentials found: s3:// references are fetched anonymously", "err", err)
	} else {
		opts = append(opts, s3.WithCredentials(creds))
	}
	if c.S3Region != "" {
		region = c.S3Region
	}
	if region != "" {
		opts = append(opts, s3.WithRegion(region))
	}
	if c.S3Endpoint != "" {
		opts = append(opts, s3.WithEndpoint(c.S3Endpoint))
	}
	src, err := s3.New(client, opts...)
	if err != nil {
		return nil, fmt.Errorf("--s3-endpoint: %w", err)
	}
	return src, nil
}

// plainCredentials warns, once per host, when a request carrying
// credentials (a hub token, a registry login or token) goes over plain HTTP
// to a host off this node, where anyone on the path can read them. It warns
// rather than refuses: in-cluster hubs and registries behind plain HTTP are
// common, and the operator chose them (--hf-endpoint,
// --insecure-registries); the log makes the exposure visible.
type plainCredentials struct {
	base   http.RoundTripper
	log    *slog.Logger
	warned *sync.Map // host -> struct{}, shared by the transports of one agent
}

// RoundTrip warns if req exposes credentials, then sends it.
func (p *plainCredentials) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme == "http" && req.Header.Get("Authorization") != "" && !isLoopbackHost(req.URL.Host) {
		if _, seen := p.warned.LoadOrStore(req.URL.Host, struct{}{}); !seen {
			p.log.Warn("credentials are sent over plain HTTP: anyone on the network path can read them; use https",
				"host", req.URL.Host, "scheme", req.URL.Scheme)
		}
	}
	return p.base.RoundTrip(req)
}

// CloseIdleConnections closes the idle connections of the transport below.
func (p *plainCredentials) CloseIdleConnections() {
	if c, ok := p.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// importer connects the queue to containerd, or returns nil when no
// containerd is configured. It connects lazily.
func (c ImportConfig) importer(store *cache.Store, platform string, log *slog.Logger, reg prometheus.Registerer) (*containerd.Importer, error) {
	if c.ContainerdAddress == "" {
		return nil, nil
	}
	cfg := containerd.DefaultConfig()
	cfg.Address, cfg.Platform = c.ContainerdAddress, platform
	if c.ContainerdNamespace != "" {
		cfg.Namespace = c.ContainerdNamespace
	}
	if c.Snapshotter != "" {
		cfg.Snapshotter = c.Snapshotter
	}
	cfg.ContentRoot = c.ContainerdContentRoot
	return containerd.New(cfg, store, containerd.WithLogger(log), containerd.WithRegisterer(reg))
}

// imageSink is where prefetched images go: the mirror learns their tags, so
// the kubelet's own pulls of them succeed with the registry down, and
// containerd imports them.
type imageSink struct {
	mirror   *mirror.Mirror       // nil without a mirror
	importer *containerd.Importer // nil without containerd
	log      *slog.Logger
}

// Import tells the mirror, then imports into containerd.
func (s imageSink) Import(ctx context.Context, img *source.Image) error {
	s.learn(img)
	if s.importer == nil {
		return nil
	}
	return s.importer.Import(ctx, img)
}

// learn tells the mirror the image's tag.
func (s imageSink) learn(img *source.Image) {
	if s.mirror == nil {
		return
	}
	if registry, repository, tag, ok := splitImageName(img.Name); ok {
		if err := s.mirror.Learn(registry, repository, tag, img.Target.Digest, img.Public); err != nil {
			s.log.Warn("the mirror could not learn a prefetched tag", "image", img.Name, "err", err)
		}
	}
}

// streamingSink is an imageSink with containerd: the queue hands it each
// blob as it lands in the cache, so writing into containerd and unpacking
// overlap the download (prefetch.StreamingImporter).
type streamingSink struct{ imageSink }

// Begin begins a streaming import; the mirror learns the tag at Commit,
// once every blob is in the cache.
func (s streamingSink) Begin(ctx context.Context, img *source.Image) (prefetch.ImageImport, error) {
	imp, err := s.importer.Begin(ctx, img)
	if err != nil {
		return nil, err
	}
	return sinkImport{ImageImport: imp, learn: func() { s.learn(img) }}, nil
}

// sinkImport is a streaming import that tells the mirror on Commit.
type sinkImport struct {
	prefetch.ImageImport
	learn func()
}

// Commit tells the mirror, then finishes the import.
func (i sinkImport) Commit(ctx context.Context) error {
	i.learn()
	return i.ImageImport.Commit(ctx)
}

// splitImageName splits "registry/repository:tag"; ok is false for names
// without a tag (pinned by digest).
func splitImageName(name string) (registry, repository, tag string, ok bool) {
	if strings.Contains(name, "@") {
		return "", "", "", false
	}
	registry, rest, found := strings.Cut(name, "/")
	i := strings.LastIndexByte(rest, ':')
	if !found || i < 0 {
		return "", "", "", false
	}
	return registry, rest[:i], rest[i+1:], true
}

// nodeMirror is the registry mirror with its listener.
type nodeMirror struct {
	cfg     MirrorConfig
	handler *mirror.Mirror
	ln      net.Listener
}

// newMirror opens the mirror's listener, or returns nil when it is disabled.
// blobSource routes the mirror's cache misses (through the swarm).
func newMirror(cfg MirrorConfig, store *cache.Store, upstream *oci.Source, blobSource mirror.BlobSource,
	log *slog.Logger, reg prometheus.Registerer,
) (*nodeMirror, error) {
	if cfg.MirrorAddr == "" {
		if len(cfg.MirrorRegistries) > 0 || cfg.HostsDir != "" {
			return nil, fmt.Errorf("--mirror-registries and --hosts-dir need --mirror-addr")
		}
		return nil, nil
	}
	if len(cfg.MirrorRegistries) == 0 {
		return nil, fmt.Errorf("--mirror-addr needs --mirror-registries: the registries to mirror")
	}
	opts := []mirror.Option{
		mirror.WithRegistries(cfg.MirrorRegistries...),
		mirror.WithStateDir(filepath.Join(store.Root(), "mirror")),
		mirror.WithLogger(log), mirror.WithRegisterer(reg),
		mirror.WithAgentCredentials(upstream.AgentCredentials()),
	}
	if blobSource != nil {
		opts = append(opts, mirror.WithBlobSource(blobSource))
	}
	h, err := mirror.New(store, upstream, opts...)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.MirrorAddr)
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("listening for the registry mirror: %w", err)
	}
	return &nodeMirror{cfg: cfg, handler: h, ln: ln}, nil
}

// configureHosts points containerd at the mirror for each mirrored registry,
// when a hosts directory is configured. Registries spoken to over plain HTTP
// keep an http:// server to fall back to.
func (m *nodeMirror) configureHosts(insecure []string) error {
	if m.cfg.HostsDir == "" {
		return nil
	}
	var opts []mirror.HostsOption
	for _, r := range m.cfg.MirrorRegistries {
		if slices.Contains(insecure, r) || isLoopbackHost(r) {
			opts = append(opts, mirror.ServerURL(r, "http://"+r))
		}
	}
	return mirror.ConfigureHosts(m.cfg.HostsDir, "http://"+m.ln.Addr().String(), m.cfg.MirrorRegistries, opts...)
}

// run serves the mirror until ctx ends.
func (m *nodeMirror) run(ctx context.Context, serve func(context.Context, net.Listener, http.Handler) error) error {
	defer m.handler.Close()
	return serve(ctx, m.ln, m.handler)
}

// isLoopbackHost reports whether host[:port] names the loopback interface.
func isLoopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

var _ prefetch.StreamingImporter = streamingSink{}
