package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/containerd"
	"github.com/weightd/weightd/pkg/kube"
)

// mirrorCheckInterval is how often the agent asks containerd again whether
// it reads the mirror's hosts.toml files, so that a containerd restarted
// with a fixed config (or restarted at all, when it could not be asked) is
// seen without restarting the agent.
const mirrorCheckInterval = 5 * time.Minute

// mirrorCheckTimeout bounds one question to containerd.
const mirrorCheckTimeout = 30 * time.Second

// mirrorCheck finds out whether containerd's CRI reads the hosts.toml files
// the agent writes into --hosts-dir, at start and every interval, and says
// so: a log line when the answer changes (an error when it does not read
// them, with the fix), weightd_mirror_containerd_config_path, the mirror's
// part of the agent's status and, with Kubernetes features on, an Event on
// the Node when it stops or starts reading them. Whatever the answer, the
// mirror runs and the hosts.toml files stay: where containerd ignores them,
// its pulls go straight to the registries.
type mirrorCheck struct {
	hostsDir string
	address  string // containerd's socket; "" when the agent has none
	interval time.Duration
	read     func(ctx context.Context, address string) (containerd.RegistryConfig, error)
	event    func(eventType, reason, message string) bool // nil without Kubernetes features
	log      *slog.Logger
	gauge    *prometheus.GaugeVec

	mu   sync.Mutex
	last mirrorCheckResult // zero before the first check
}

// mirrorCheckResult is one check's answer.
type mirrorCheckResult struct {
	state      string // one of api.ConfigPathStates
	configPath string // as containerd reported it
	version    string // containerd's
	problem    string // what is wrong and the fix; "" when configured
}

// newMirrorCheck returns the check of m's hosts directory against the
// containerd at address ("" when the agent has none), or nil when the
// agent writes no hosts.toml. event, when not nil, records an Event on the
// node. It registers weightd_mirror_containerd_config_path on reg.
func newMirrorCheck(m *nodeMirror, address string, event func(eventType, reason, message string) bool, log *slog.Logger, reg prometheus.Registerer) (*mirrorCheck, error) {
	if m == nil || m.cfg.HostsDir == "" {
		return nil, nil
	}
	c := &mirrorCheck{
		hostsDir: m.cfg.HostsDir, address: address, interval: mirrorCheckInterval,
		read: containerd.ReadRegistryConfig, event: event, log: log,
		gauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "weightd_mirror_containerd_config_path",
			Help: "1 for the state of containerd's CRI registry config_path, 0 for the others: configured (containerd reads the hosts.toml files of --hosts-dir, so the kubelet's pulls go through the mirror), mismatch (it reads another directory), unset (it reads none), unknown (containerd could not be asked); all 0 until first asked.",
		}, []string{"state"}),
	}
	for _, s := range api.ConfigPathStates {
		c.gauge.WithLabelValues(s)
	}
	if err := reg.Register(c.gauge); err != nil {
		return nil, err
	}
	return c, nil
}

// Run checks at once, then every interval, until ctx ends.
func (c *mirrorCheck) Run(ctx context.Context) error {
	tick := time.NewTicker(c.interval)
	defer tick.Stop()
	for {
		r := c.check(ctx)
		if ctx.Err() != nil {
			return nil // an answer cut short by the shutdown says nothing
		}
		c.report(r)
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// check asks containerd and classifies its answer.
func (c *mirrorCheck) check(ctx context.Context) mirrorCheckResult {
	if c.address == "" {
		return mirrorCheckResult{state: api.ConfigPathUnknown, problem: fmt.Sprintf(
			"no --containerd-address to ask containerd whether it reads the hosts.toml files in %s; if the kubelet's pulls bypass the mirror, %s",
			c.hostsDir, fixConfigPath("", c.hostsDir))}
	}
	ctx, cancel := context.WithTimeout(ctx, mirrorCheckTimeout)
	defer cancel()
	rc, err := c.read(ctx, c.address)
	return classifyConfigPath(rc, err, c.hostsDir)
}

// classifyConfigPath turns what containerd reported (rc, err) into a
// state and, unless configured, what is wrong and how to fix it.
func classifyConfigPath(rc containerd.RegistryConfig, err error, hostsDir string) mirrorCheckResult {
	r := mirrorCheckResult{configPath: rc.ConfigPath, version: rc.Version}
	fix := fixConfigPath(rc.Version, hostsDir)
	if err != nil {
		r.state, r.configPath = api.ConfigPathUnknown, ""
		why := "cannot ask containerd"
		if errors.Is(err, containerd.ErrRegistryConfigUnreported) {
			why = "containerd does not say"
		}
		r.problem = fmt.Sprintf("%s whether it reads the hosts.toml files in %s (%v); if the kubelet's pulls bypass the mirror, %s", why, hostsDir, err, fix)
		return r
	}
	reads, why := rc.ReadsHostsDir(hostsDir)
	switch {
	case reads:
		r.state = api.ConfigPathConfigured
		return r
	case rc.ConfigPath == "":
		r.state = api.ConfigPathUnset
		r.problem = fmt.Sprintf("containerd %s's CRI has no registry config_path, so it reads none of the hosts.toml files in %s: the kubelet's pulls bypass the mirror and go straight to the registries; %s", rc.Version, hostsDir, fix)
		if len(rc.Mirrors) > 0 {
			r.problem += fmt.Sprintf(", and move the deprecated registry.mirrors of %s into hosts.toml files (containerd refuses both)", strings.Join(rc.Mirrors, ", "))
		}
	default:
		r.state = api.ConfigPathMismatch
		r.problem = fmt.Sprintf("%s: the kubelet's pulls bypass the mirror and go straight to the registries; %s, or point --hosts-dir at containerd's directory (mounted at the same path)", why, fix)
	}
	return r
}

// fixConfigPath is how to make containerd of version read hostsDir: the
// table of its config file for that version, or both when unknown.
func fixConfigPath(version, hostsDir string) string {
	set := fmt.Sprintf("config_path = %q", hostsDir)
	if table := containerd.RegistryConfigTable(version); table != "" {
		return fmt.Sprintf("set %s %s in containerd's config.toml and restart containerd", table, set)
	}
	return fmt.Sprintf("set %s %s (containerd 2.x; %s on 1.x) in containerd's config.toml and restart containerd",
		containerd.RegistryConfigTable("2."), set, containerd.RegistryConfigTable("1."))
}

// report publishes r: the gauge and the status always; a log line, and an
// Event on the node, when the state changes.
func (c *mirrorCheck) report(r mirrorCheckResult) {
	for _, s := range api.ConfigPathStates {
		v := 0.0
		if s == r.state {
			v = 1
		}
		c.gauge.WithLabelValues(s).Set(v)
	}
	c.mu.Lock()
	prev := c.last
	c.last = r
	c.mu.Unlock()
	if prev.state == r.state {
		return
	}
	attrs := []any{"hosts_dir", c.hostsDir, "config_path", r.configPath, "containerd", r.version}
	switch r.state {
	case api.ConfigPathConfigured:
		c.log.Info("containerd reads the mirror's hosts.toml files: the kubelet's pulls go through the mirror", attrs...)
		if prev.state == api.ConfigPathUnset || prev.state == api.ConfigPathMismatch {
			c.nodeEvent(corev1.EventTypeNormal, kube.ReasonMirrorConfigured,
				fmt.Sprintf("containerd reads the registry mirror's hosts.toml files in %s again", c.hostsDir))
		}
	case api.ConfigPathUnknown:
		c.log.Warn("the registry mirror runs, but whether containerd uses it is unknown: "+r.problem, attrs...)
	default:
		c.log.Error("the registry mirror runs, but containerd does not use it: "+r.problem, append(attrs, "state", r.state)...)
		c.nodeEvent(corev1.EventTypeWarning, kube.ReasonMirrorNotConfigured, "registry mirror unused: "+r.problem)
	}
}

func (c *mirrorCheck) nodeEvent(eventType, reason, message string) {
	if c.event != nil && !c.event(eventType, reason, message) {
		c.log.Warn("too many Events queued for the node: one dropped", "reason", reason)
	}
}

// status fills the check's part of the mirror's status.
func (c *mirrorCheck) status(st *api.MirrorStatus) {
	c.mu.Lock()
	r := c.last
	c.mu.Unlock()
	st.ConfigPathState, st.ConfigPath, st.ContainerdVersion, st.Problem = r.state, r.configPath, r.version, r.problem
}

// status is the mirror's part of the agent's status; check is nil when the
// agent writes no hosts.toml.
func (m *nodeMirror) status(check *mirrorCheck) api.MirrorStatus {
	st := api.MirrorStatus{Addr: m.ln.Addr().String(), Registries: slices.Clone(m.cfg.MirrorRegistries), HostsDir: m.cfg.HostsDir}
	if check != nil {
		check.status(&st)
	}
	return st
}
