package benchnet

import (
	"bytes"
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

	"github.com/weightd/weightd/internal/genmodel"
	"github.com/weightd/weightd/internal/testbed"
)

// StartOrigin runs the origin in host h and waits (10 s at most) until it
// answers on its control socket. stop ends it (SIGTERM) and waits.
func StartOrigin(ctx context.Context, h *testbed.Host, exe, dir, addr, control string) (stop func(), err error) {
	return startServer(ctx, h, "origin", exe, []string{"-serve-origin", dir, "-listen", addr, "-control", control},
		func(ctx context.Context) error {
			_, err := OriginBytes(ctx, control)
			return err
		})
}

// startServer runs exe with args in host h, as the server called name, and
// waits (10 s at most) until ready succeeds. stop ends it (SIGTERM, SIGKILL
// after 10 s) and waits.
func startServer(ctx context.Context, h *testbed.Host, name, exe string, args []string, ready func(context.Context) error) (stop func(), err error) {
	sctx, cancel := context.WithCancel(ctx)
	cmd := h.Command(sctx, exe, args...)
	// In a process group of its own: a Ctrl-C in the terminal reaches only
	// the bench, which stops it in order.
	cmd.SysProcAttr.Setpgid = true
	cmd.Stderr = &LineWriter{Prefix: name + ": ", W: os.Stderr}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	if err := cmd.Start(); err != nil {
		cancel()
		return nil, fmt.Errorf("starting the %s: %w", name, err)
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
		err := ready(ctx)
		if err == nil {
			return stop, nil
		}
		select {
		case <-exited:
			return nil, fmt.Errorf("the %s exited at start: %v", name, werr)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			stop()
			return nil, fmt.Errorf("the %s did not answer within 10s: %w", name, err)
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
	srv := genmodel.NewServer(ln, dir)
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
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b, err := controlCall(ctx, control, http.MethodGet, "/bytes", nil)
	if err != nil {
		return 0, fmt.Errorf("asking the origin for its egress: %w", err)
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// controlCall sends a request to a server's control socket and returns the
// body of its 200 answer (1 MiB at most).
func controlCall(ctx context.Context, control, method, path string, body []byte) ([]byte, error) {
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", control)
		},
	}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, method, "http://control"+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, bytes.TrimSpace(b))
	}
	return b, nil
}
