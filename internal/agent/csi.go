package agent

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/csi"
	"github.com/weightd/weightd/pkg/prefetch"
)

// CSIConfig configures the CSI node plugin (models as volumes).
type CSIConfig struct {
	CSIEndpoint            string `name:"csi-endpoint" help:"unix:// socket of the CSI node plugin (driver models.weightd.io), e.g. unix:///var/lib/kubelet/plugins/models.weightd.io/csi.sock; empty disables it." env:"WEIGHTD_CSI_ENDPOINT"`
	KubeletRegistrationDir string `name:"kubelet-registration-dir" help:"The kubelet's plugin-registration directory, where the agent serves models.weightd.io-reg.sock so the kubelet finds the CSI plugin without a registrar sidecar." default:"/var/lib/kubelet/plugins_registry" env:"WEIGHTD_KUBELET_REGISTRATION_DIR" type:"path"`
	KubeletDir             string `name:"kubelet-dir" help:"The kubelet's directory: the CSI plugin mounts model volumes only at targets under it (mounted into the agent with Bidirectional propagation)." default:"/var/lib/kubelet" env:"WEIGHTD_KUBELET_DIR" type:"path"`
	CSIAllowedRefs         string `name:"csi-allowed-refs" help:"Which references each namespace may mount as a CSI volume: NS=PREFIX[;PREFIX…],… (NS * is every namespace, PREFIX * every reference), compared with the canonical reference (hf://org/name@rev, oci://host/repo:tag). Default: any reference; whose credentials fetch it is --agent-credentials' rule." env:"WEIGHTD_CSI_ALLOWED_REFS"`
}

// newCSI builds the CSI plugin's server, or returns nil when it is off. Its
// records live under <root>/csi; volumes it finds no longer mounted are
// released before it serves. announce, when not nil, tells pods what their
// volumes resolved to.
func newCSI(cfg CSIConfig, root, nodeName, version string, store *cache.Store, queue *prefetch.Queue, announce func(context.Context, csi.Published), log *slog.Logger) (*csi.Server, error) {
	if cfg.CSIEndpoint == "" {
		return nil, nil
	}
	allow, err := csi.ParseAllowlist(cfg.CSIAllowedRefs)
	if err != nil {
		return nil, fmt.Errorf("--csi-allowed-refs: %w", err)
	}
	if nodeName == "" {
		if nodeName, err = os.Hostname(); err != nil {
			return nil, fmt.Errorf("csi: node name: %w", err)
		}
	}
	driver, err := csi.NewDriver(store, queue, csi.Config{
		NodeID: nodeName, StateDir: filepath.Join(root, "csi"), TargetRoot: cfg.KubeletDir,
		Allow: allow, Version: version, Announce: announce, Logger: log,
	})
	if err != nil {
		return nil, err
	}
	if err := driver.Reconcile(); err != nil {
		log.Warn("reconciling CSI volumes with the node's mounts", "err", err)
	}
	return csi.NewServer(driver, cfg.CSIEndpoint, cfg.KubeletRegistrationDir)
}

// csiVolumes lists the plugin's published volumes for the API's status; a
// record it cannot read is logged and left out.
func csiVolumes(srv *csi.Server, log *slog.Logger) func() []api.Volume {
	return func() []api.Volume {
		vols, err := srv.Volumes()
		if err != nil {
			log.Warn("listing CSI volumes", "err", err)
		}
		out := make([]api.Volume, 0, len(vols))
		for _, v := range vols {
			out = append(out, api.Volume{ID: v.ID, Namespace: v.Namespace, Pod: v.Pod, PodUID: v.PodUID,
				Name: v.Name, Ref: v.Ref, Blobs: v.Blobs, Bytes: v.Bytes})
		}
		return out
	}
}
