package api

// States of MirrorStatus.ConfigPathState: whether containerd's CRI reads
// the hosts.toml files the agent writes for its registry mirror.
const (
	// ConfigPathConfigured: containerd's registry config_path is the
	// agent's hosts directory; the kubelet's pulls go through the mirror.
	ConfigPathConfigured = "configured"
	// ConfigPathMismatch: config_path is set, but containerd does not read
	// the agent's hosts directory (another directory, or a list that
	// containerd 2.x does not split).
	ConfigPathMismatch = "mismatch"
	// ConfigPathUnset: containerd has no config_path and reads no
	// hosts.toml at all.
	ConfigPathUnset = "unset"
	// ConfigPathUnknown: containerd could not be asked, or does not say.
	ConfigPathUnknown = "unknown"
)

// ConfigPathStates lists every ConfigPathState.
var ConfigPathStates = []string{ConfigPathConfigured, ConfigPathMismatch, ConfigPathUnset, ConfigPathUnknown}

// MirrorStatus is the registry mirror's part of GET /v1/status. When the
// kubelet's pulls bypass the mirror they still work: containerd goes
// straight to the registries.
type MirrorStatus struct {
	// Addr is the address the mirror listens on.
	Addr string `json:"addr"`
	// Registries are the registries it mirrors.
	Registries []string `json:"registries"`
	// HostsDir is where the agent writes containerd's hosts.toml files;
	// empty when it writes none.
	HostsDir string `json:"hostsDir,omitempty"`
	// ConfigPathState is one of ConfigPathStates; empty without HostsDir
	// or before the agent first asked containerd.
	ConfigPathState string `json:"configPathState,omitempty"`
	// ConfigPath is the CRI registry config_path as containerd reported
	// it, in containerd's own paths.
	ConfigPath string `json:"configPath,omitempty"`
	// ContainerdVersion is the version of the containerd asked.
	ContainerdVersion string `json:"containerdVersion,omitempty"`
	// Problem says what is wrong and how to fix it; empty when configured.
	Problem string `json:"problem,omitempty"`
}

// WithMirror sets where GET /v1/status learns the registry mirror's state.
func WithMirror(mirror func() MirrorStatus) Option {
	return func(s *Server) error { s.mirror = mirror; return nil }
}
