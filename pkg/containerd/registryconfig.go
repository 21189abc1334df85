package containerd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
)

// Where containerd reports its CRI registry configuration. containerd 2.4
// and later: the CRI image plugin (io.containerd.cri.v1, id images) exports
// RegistryConfigPath through the introspection service, after its default
// (on Linux, /etc/containerd/certs.d:/etc/docker/certs.d when neither
// config_path nor mirrors are set). containerd 1.x: the CRI's
// runtime.v1.RuntimeService/Status, verbose, answers an info map whose
// "config" entry is the CRI plugin's config as JSON, with
// registry.configPath and registry.mirrors. containerd 2.0 to 2.3 say it
// nowhere: their Status config is the runtime's alone, since the image
// settings moved to io.containerd.cri.v1.images, and that plugin exports no
// registry setting.
const (
	criImagesPluginType      = "io.containerd.cri.v1"
	criImagesPluginID        = "images"
	exportRegistryConfigPath = "RegistryConfigPath"
	criStatusMethod          = "/runtime.v1.RuntimeService/Status"
)

// Values of RegistryConfig.From.
const (
	// FromIntrospection: the CRI image plugin's RegistryConfigPath export
	// (containerd 2.4 and later).
	FromIntrospection = "introspection"
	// FromCRIStatus: the "config" entry of the CRI's verbose Status info
	// (containerd 1.x).
	FromCRIStatus = "cri-status"
)

// ErrRegistryConfigUnreported means containerd answered but does not say
// what its CRI registry config_path is: it serves no CRI, its CRI image
// plugin failed to start, or it is a 2.0 to 2.3 release.
var ErrRegistryConfigUnreported = errors.New("containerd does not report its CRI registry config_path")

// RegistryConfig is the CRI plugin's registry configuration as containerd
// reports it: where the kubelet's pulls look for hosts.toml files.
type RegistryConfig struct {
	// Version is containerd's version, as it says it ("1.6.20", "v2.4.2").
	Version string
	// ConfigPath is registry.config_path after containerd's defaults: the
	// directories of <host>/hosts.toml files, several separated by ':'
	// (ConfigPaths); empty when unset, and then containerd reads no
	// hosts.toml at all. The paths are containerd's own: the same here only
	// where this process sees them mounted at the same place.
	ConfigPath string
	// Mirrors are the registries of the deprecated registry.mirrors tables,
	// which containerd 1.x uses when ConfigPath is empty (sorted; 1.x
	// reports them, 2.x does not).
	Mirrors []string
	// From says where containerd reported it: FromIntrospection or
	// FromCRIStatus.
	From string
}

// ConfigPaths is ConfigPath split as the CRI's pulls split it
// (filepath.SplitList): the directories looked in for a registry's
// hosts.toml, first to last; none when unset.
func (c RegistryConfig) ConfigPaths() []string {
	return filepath.SplitList(c.ConfigPath)
}

// ReadsHostsDir says whether the CRI's pulls read the <registry>/hosts.toml
// files of dir, a directory as this process sees it, and if not, why. dir
// is read when it is one of ConfigPaths (the same path, or the same
// directory where this process sees containerd's path too), except on
// containerd 2.x with several: its CRI pulls through the transfer service
// unless use_local_image_pull is set (or implied), and the transfer
// service takes config_path as one directory, not a list (containerd issue
// 12636, still so in 2.4.2), so that none of them is read. On 1.x, the
// first directory of the list that has a subdirectory for a registry is
// the one read for it.
func (c RegistryConfig) ReadsHostsDir(dir string) (bool, string) {
	paths := c.ConfigPaths()
	if len(paths) == 0 {
		return false, "containerd's CRI has no registry config_path: it reads no hosts.toml"
	}
	found := slices.ContainsFunc(paths, func(p string) bool { return sameDir(p, dir) })
	if len(paths) > 1 && strings.HasPrefix(strings.TrimPrefix(c.Version, "v"), "2.") {
		if found {
			return false, fmt.Sprintf("containerd %s's registry config_path %q is a list: its CRI pulls through the transfer service take it as one directory and read no hosts.toml (unless use_local_image_pull = true)", c.Version, c.ConfigPath)
		}
		return false, fmt.Sprintf("containerd %s's registry config_path %q is a list, without %s, which its CRI pulls through the transfer service would not read anyway", c.Version, c.ConfigPath, dir)
	}
	if !found {
		return false, fmt.Sprintf("containerd's registry config_path is %q, not %s", c.ConfigPath, dir)
	}
	return true, ""
}

// sameDir reports whether containerd's path p is dir: the same cleaned
// path, or the same directory where both exist here.
func sameDir(p, dir string) bool {
	if p == "" || dir == "" {
		return false
	}
	if filepath.Clean(p) == filepath.Clean(dir) {
		return true
	}
	a, err := os.Stat(p)
	if err != nil {
		return false
	}
	b, err := os.Stat(dir)
	return err == nil && a.IsDir() && os.SameFile(a, b)
}

// RegistryConfigTable is the TOML table of containerd's config file that
// holds the CRI registry's config_path for containerd version ("1.6.20",
// "v2.4.2"), or "" for a version that is neither 1.x nor 2.x.
func RegistryConfigTable(version string) string {
	v := strings.TrimPrefix(version, "v")
	switch {
	case strings.HasPrefix(v, "1."):
		return `[plugins."io.containerd.grpc.v1.cri".registry]`
	case strings.HasPrefix(v, "2."):
		return `[plugins."io.containerd.cri.v1.images".registry]`
	}
	return ""
}

// ReadRegistryConfig asks the containerd listening on address what its CRI
// plugin's registry config_path is: through the introspection service
// (2.4 and later), else through the CRI's verbose Status (1.x). An error
// wrapping ErrRegistryConfigUnreported means containerd answered without
// saying; any other, that it could not be asked. The RegistryConfig holds
// what was learnt (the version) either way.
func ReadRegistryConfig(ctx context.Context, address string) (RegistryConfig, error) {
	var rc RegistryConfig
	c, err := containerd.New(address, containerd.WithTimeout(5*time.Second))
	if err != nil {
		return rc, fmt.Errorf("connecting to containerd at %s: %w", address, err)
	}
	defer c.Close()
	v, err := c.Version(ctx)
	if err != nil {
		return rc, fmt.Errorf("asking containerd at %s for its version: %w", address, err)
	}
	rc.Version = v.Version

	resp, err := c.IntrospectionService().Plugins(ctx,
		`type==`+strconv.Quote(criImagesPluginType)+`,id==`+strconv.Quote(criImagesPluginID))
	if err != nil {
		return rc, fmt.Errorf("asking containerd %s for its CRI image plugin: %w", rc.Version, err)
	}
	for _, p := range resp.GetPlugins() {
		if ie := p.GetInitErr(); ie != nil {
			return rc, fmt.Errorf("%w: containerd %s's CRI image plugin failed to start: %s", ErrRegistryConfigUnreported, rc.Version, ie.GetMessage())
		}
		if path, ok := p.GetExports()[exportRegistryConfigPath]; ok {
			rc.ConfigPath, rc.From = path, FromIntrospection
			return rc, nil
		}
	}

	conn, ok := c.Conn().(grpc.ClientConnInterface)
	if !ok {
		return rc, fmt.Errorf("containerd client: connection is a %T", c.Conn())
	}
	req := criStatusRequest()
	var out []byte
	if err := conn.Invoke(ctx, criStatusMethod, &req, &out, grpc.ForceCodecV2(RawCodec{})); err != nil {
		if status.Code(err) == codes.Unimplemented {
			return rc, fmt.Errorf("%w: containerd %s serves no CRI: %w", ErrRegistryConfigUnreported, rc.Version, err)
		}
		return rc, fmt.Errorf("asking containerd %s's CRI for its status: %w", rc.Version, err)
	}
	info, err := parseCRIStatusInfo(out)
	if err != nil {
		return rc, fmt.Errorf("containerd %s's CRI status: %w", rc.Version, err)
	}
	path, mirrors, ok, err := parseCRIConfig(info["config"])
	if err != nil {
		return rc, fmt.Errorf("containerd %s's CRI status: %w", rc.Version, err)
	}
	if !ok {
		return rc, fmt.Errorf("%w: containerd %s's CRI status holds no registry config (2.0 to 2.3 report it nowhere)", ErrRegistryConfigUnreported, rc.Version)
	}
	rc.ConfigPath, rc.Mirrors, rc.From = path, mirrors, FromCRIStatus
	return rc, nil
}

// criStatusRequest is StatusRequest{verbose: true}, encoded by hand to keep
// k8s.io/cri-api out of the module.
func criStatusRequest() []byte {
	b := protowire.AppendTag(nil, 1, protowire.VarintType)
	return protowire.AppendVarint(b, 1)
}

// maxStatusInfo bounds the entries taken from a Status answer's info map:
// containerd sends a handful (config, golang, cniconfig, the CNI load
// statuses).
const maxStatusInfo = 1024

// parseCRIStatusInfo returns the info map of a StatusResponse: field 2,
// map<string, string>, each entry a message {key = 1, value = 2}. A key
// seen twice keeps its last value, as protobuf decoders do.
func parseCRIStatusInfo(b []byte) (map[string]string, error) {
	info := map[string]string{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, fmt.Errorf("decoding StatusResponse: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if num != 2 || typ != protowire.BytesType {
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return nil, fmt.Errorf("decoding StatusResponse: %w", protowire.ParseError(n))
			}
			b = b[n:]
			continue
		}
		entry, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return nil, fmt.Errorf("decoding StatusResponse: %w", protowire.ParseError(n))
		}
		b = b[n:]
		k, v, err := parseMapEntry(entry)
		if err != nil {
			return nil, fmt.Errorf("decoding StatusResponse info: %w", err)
		}
		if _, seen := info[k]; !seen && len(info) >= maxStatusInfo {
			return nil, fmt.Errorf("decoding StatusResponse info: over %d entries", maxStatusInfo)
		}
		info[k] = v
	}
	return info, nil
}

// parseMapEntry decodes a map<string, string> entry: key = 1, value = 2,
// either missing meaning "".
func parseMapEntry(b []byte) (key, value string, err error) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return "", "", protowire.ParseError(n)
		}
		b = b[n:]
		if (num == 1 || num == 2) && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return "", "", protowire.ParseError(n)
			}
			b = b[n:]
			if num == 1 {
				key = string(v)
			} else {
				value = string(v)
			}
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return "", "", protowire.ParseError(n)
		}
		b = b[n:]
	}
	return key, value, nil
}

// parseCRIConfig reads the registry settings from the JSON of a 1.x CRI
// plugin's config (the Status info's "config"): registry.configPath and the
// registries of registry.mirrors. ok is false when the JSON has no registry
// object (containerd 2.x, or no "config" entry at all).
func parseCRIConfig(s string) (configPath string, mirrors []string, ok bool, err error) {
	if s == "" {
		return "", nil, false, nil
	}
	var cfg struct {
		Registry *struct {
			ConfigPath string                     `json:"configPath"`
			Mirrors    map[string]json.RawMessage `json:"mirrors"`
		} `json:"registry"`
	}
	if err := json.Unmarshal([]byte(s), &cfg); err != nil {
		return "", nil, false, fmt.Errorf("decoding the CRI config: %w", err)
	}
	if cfg.Registry == nil {
		return "", nil, false, nil
	}
	for host := range cfg.Registry.Mirrors {
		mirrors = append(mirrors, host)
	}
	slices.Sort(mirrors)
	return cfg.Registry.ConfigPath, mirrors, true, nil
}

// RawCodec passes already-encoded protobuf messages (*[]byte) through
// gRPC, for the few CRI calls made without k8s.io/cri-api's types.
type RawCodec struct{}

func (RawCodec) Name() string { return "proto" }

func (RawCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("RawCodec: cannot marshal %T", v)
	}
	return mem.BufferSlice{mem.SliceBuffer(*b)}, nil
}

func (RawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("RawCodec: cannot unmarshal into %T", v)
	}
	*b = data.Materialize()
	return nil
}
