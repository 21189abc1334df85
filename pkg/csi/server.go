package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// RegistrationSocketName is the socket the agent serves in the kubelet's
// plugin-registration directory.
const RegistrationSocketName = DriverName + "-reg.sock"

// SocketPath returns the filesystem path of a "unix:///path" (or bare path)
// endpoint.
func SocketPath(endpoint string) (string, error) {
	p := endpoint
	if strings.Contains(endpoint, "://") {
		u, err := url.Parse(endpoint)
		if err != nil {
			return "", fmt.Errorf("csi endpoint %q: %w", endpoint, err)
		}
		if u.Scheme != "unix" {
			return "", fmt.Errorf("csi endpoint %q: only unix:// sockets are served", endpoint)
		}
		p = u.Path
	}
	if !filepath.IsAbs(p) {
		return "", fmt.Errorf("csi endpoint %q: not an absolute socket path", endpoint)
	}
	return filepath.Clean(p), nil
}

// Server serves a Driver on its CSI socket and registers it with the kubelet
// through a registration socket in the kubelet's plugins_registry directory.
type Server struct {
	driver          *Driver
	socket          string
	registrationDir string
	log             *slog.Logger
	listening       atomic.Bool
}

// Listening reports whether both sockets accept connections, so the agent
// is not reported ready before the kubelet can reach its plugin.
func (s *Server) Listening() bool { return s.listening.Load() }

// Volumes lists the published volumes (Driver.Volumes).
func (s *Server) Volumes() ([]Volume, error) { return s.driver.Volumes() }

// NewServer returns a server for driver on the CSI endpoint (unix://…);
// with registrationDir empty it serves no registration socket.
func NewServer(driver *Driver, endpoint, registrationDir string) (*Server, error) {
	socket, err := SocketPath(endpoint)
	if err != nil {
		return nil, err
	}
	return &Server{driver: driver, socket: socket, registrationDir: registrationDir, log: driver.cfg.Logger}, nil
}

// Run serves until ctx ends. The registration socket is served last, once
// the CSI socket is listening, because the kubelet dials the CSI socket as
// soon as it sees the registration one.
func (s *Server) Run(ctx context.Context) error {
	csiLis, err := listenUnix(s.socket)
	if err != nil {
		return err
	}
	csiSrv := grpc.NewServer()
	csipb.RegisterIdentityServer(csiSrv, s.driver)
	csipb.RegisterNodeServer(csiSrv, s.driver)
	servers := []*grpc.Server{csiSrv}
	listeners := []net.Listener{csiLis}
	if s.registrationDir != "" {
		regLis, err := listenUnix(filepath.Join(s.registrationDir, RegistrationSocketName))
		if err != nil {
			csiLis.Close()
			return err
		}
		regSrv := grpc.NewServer()
		registerapi.RegisterRegistrationServer(regSrv, &registration{endpoint: s.socket, log: s.log})
		servers = append(servers, regSrv)
		listeners = append(listeners, regLis)
	}
	s.listening.Store(true)
	defer s.listening.Store(false)
	g, ctx := errgroup.WithContext(ctx)
	for i := range servers {
		g.Go(func() error { return servers[i].Serve(listeners[i]) })
	}
	g.Go(func() error {
		<-ctx.Done()
		for _, srv := range servers {
			srv.GracefulStop()
		}
		return nil
	})
	err = g.Wait()
	if errors.Is(err, grpc.ErrServerStopped) {
		err = nil
	}
	return err
}

// listenUnix listens on p, replacing a socket left by an earlier run.
func listenUnix(p string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
		return nil, err
	}
	if st, err := os.Lstat(p); err == nil {
		if st.Mode().Type() != os.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a socket", p)
		}
		if err := os.Remove(p); err != nil {
			return nil, err
		}
	}
	l, err := net.Listen("unix", p)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", p, err)
	}
	return l, nil
}

// registration answers the kubelet's plugin watcher.
type registration struct {
	registerapi.UnimplementedRegistrationServer
	endpoint string
	log      *slog.Logger
}

// GetInfo tells the kubelet what this plugin is and where its CSI socket is.
func (r *registration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              DriverName,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

// NotifyRegistrationStatus logs the kubelet's verdict.
func (r *registration) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if st.GetPluginRegistered() {
		r.log.Info("registered with the kubelet", "driver", DriverName)
	} else {
		r.log.Error("the kubelet refused the CSI plugin's registration", "driver", DriverName, "error", st.GetError())
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}
