package containerd

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/containerd/platforms"
	"github.com/prometheus/client_golang/prometheus"
)

// Config says which containerd to import into and how.
type Config struct {
	// Address is containerd's gRPC socket.
	Address string
	// Namespace is the containerd namespace of the image records: "k8s.io"
	// is the one the kubelet's CRI plugin reads.
	Namespace string
	// Snapshotter is the snapshotter images are unpacked for: the CRI
	// plugin's, "overlayfs" on most nodes.
	Snapshotter string
	// Platform selects the manifest of an index and the platform images must
	// be for, as "os/arch[/variant]". Empty means this node's.
	Platform string
	// Concurrency is how many blobs are written into containerd at once.
	Concurrency int
	// ContentRoot is containerd's content store directory as this process
	// sees it (containerd's root, then io.containerd.content.v1.content).
	// Where it is in the cache's mount (the same filesystem is not enough:
	// Linux refuses links between two bind mounts), a blob containerd lacks is
	// hard-linked into it (after its digest is checked) and containerd's
	// content sharing registers it in the namespace, instead of its bytes
	// being written over gRPC. Empty asks containerd where its content
	// store is; ContentRootNone turns linking off. Whenever a link cannot
	// be made (another filesystem, a directory missing here, no
	// permission), blobs are written over gRPC. The path containerd gives
	// is its own: asking it serves where this process sees containerd's
	// directory at the same path.
	ContentRoot string
}

// ContentRootNone as Config.ContentRoot writes every blob over gRPC.
const ContentRootNone = "none"

// DefaultConfig is a Kubernetes node's containerd.
func DefaultConfig() Config {
	return Config{
		Address:     "/run/containerd/containerd.sock",
		Namespace:   "k8s.io",
		Snapshotter: "overlayfs",
		Platform:    platforms.DefaultString(),
		Concurrency: 4,
	}
}

// withDefaults fills in the zero fields from DefaultConfig and checks the
// rest.
func (c Config) withDefaults() (Config, error) {
	d := DefaultConfig()
	if c.Address == "" {
		c.Address = d.Address
	}
	if c.Namespace == "" {
		c.Namespace = d.Namespace
	}
	if c.Snapshotter == "" {
		c.Snapshotter = d.Snapshotter
	}
	if c.Platform == "" {
		c.Platform = d.Platform
	}
	if c.Concurrency == 0 {
		c.Concurrency = d.Concurrency
	}
	if c.Concurrency < 0 {
		return c, fmt.Errorf("%w: concurrency %d", ErrInvalidConfig, c.Concurrency)
	}
	if c.ContentRoot != "" && c.ContentRoot != ContentRootNone && !filepath.IsAbs(c.ContentRoot) {
		return c, fmt.Errorf("%w: content root %q is not an absolute path", ErrInvalidConfig, c.ContentRoot)
	}
	if _, err := platforms.Parse(c.Platform); err != nil {
		return c, fmt.Errorf("%w: platform %q: %v", ErrInvalidConfig, c.Platform, err)
	}
	return c, nil
}

// ErrInvalidConfig is returned by New for a Config or Option it cannot use.
var ErrInvalidConfig = errors.New("invalid importer configuration")

// Option configures an Importer.
type Option func(*options) error

type options struct {
	logger     *slog.Logger
	registerer prometheus.Registerer
}

// WithLogger sets the logger; the importer is silent by default.
func WithLogger(l *slog.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidConfig)
		}
		o.logger = l
		return nil
	}
}

// WithRegisterer registers the importer's metrics on r.
func WithRegisterer(r prometheus.Registerer) Option {
	return func(o *options) error {
		o.registerer = r
		return nil
	}
}

type metrics struct {
	seconds *prometheus.HistogramVec
	bytes   prometheus.Counter
}

func newMetrics(r prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "weightd_image_import_seconds",
			Help:    "Time to import one image from the cache into containerd: write its missing blobs, unpack it and create its record.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2.5, 14),
		}, []string{"outcome"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_image_import_bytes_total",
			Help: "Bytes written from the cache into containerd's content store.",
		}),
	}
	// Both outcomes exist from the start, at zero.
	m.seconds.WithLabelValues(outcomeOK)
	m.seconds.WithLabelValues(outcomeError)
	if r == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.seconds, m.bytes} {
		if err := r.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

const (
	outcomeOK    = "ok"
	outcomeError = "error"
)
