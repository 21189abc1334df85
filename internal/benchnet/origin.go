package benchnet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/pkg/origin"
)

// StartOrigin runs the origin in host h and waits (10 s at most) until it
// answers on its control socket. stop ends it (SIGTERM) and waits.
func StartOrigin(ctx context.Context, h *testbed.Host, exe, dir, addr, control string) (stop func(), err error) {
	octx, cancel := context.WithCancel(ctx)
	cmd := h.Command(octx, exe, "-serve-origin", dir, "-listen", addr, "-control", control)
	// In a process group of its own: a Ctrl-C in the terminal reaches only
	// the bench, which stops it in order.
	cmd.SysProcAttr.Setpgid = true
	cmd.Stderr = &LineWriter{Prefix: "origin: ", W: os.Stderr}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	if err := cmd.Start(); err != nil {
		cancel()
		return nil, fmt.Errorf("starting the origin: %w", err)
	}
	exited := make(chan struct{})
	var werr error
	go func() {
		werr = cmd.Wait()
		close(exited)
	}()
	stop = func() {
		cancel()
		<-exited
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := OriginBytes(ctx, control); err == nil {
			return stop, nil
		}
		select {
		case <-exited:
			return nil, fmt.Errorf("the origin exited at start: %v", werr)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			stop()
			return nil, fmt.Errorf("the origin did not answer on %s within 10s", control)
		}
	}
}

// ServeOrigin serves dir on listen (inside the origin host) until SIGTERM or
// SIGINT, and answers GET /bytes on the unix socket control with the body
// bytes the origin has sent so far.
func ServeOrigin(dir, listen, control string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	srv := origin.NewServer(ln, dir)
	cln, err := net.Listen("unix", control)
	if err != nil {
		ln.Close()
		return err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /bytes", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, srv.BytesServed())
	})
	cs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return srv.Run(ctx) })
	g.Go(func() error {
		if err := cs.Serve(cln); !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	})
	g.Go(func() error {
		<-ctx.Done()
		return cs.Close()
	})
	err = g.Wait()
	fmt.Fprintf(os.Stderr, "served %d bytes in %d requests\n", srv.BytesServed(), srv.Requests())
	return err
}

// OriginBytes asks the origin, through its control socket, how many body
// bytes it has sent.
func OriginBytes(ctx context.Context, control string) (int64, error) {
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", control)
		},
	}}
	defer hc.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://origin/bytes", nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, fmt.Errorf("asking the origin for its egress: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64))
	if err != nil {
		return 0, fmt.Errorf("asking the origin for its egress: %w", err)
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}
