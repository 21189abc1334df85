package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
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

	"github.com/weightd/weightd/pkg/origin"
)

// The bench re-executes itself inside the testbed's hosts for the programs
// that must run there: the origin and the naive downloader.

// serveOrigin serves dir on listen (inside the origin host) until SIGTERM or
// SIGINT, and answers GET /bytes on the unix socket control with the body
// bytes the origin has sent so far: its egress.
func serveOrigin(dir, listen, control string) error {
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

// originBytes asks the origin, through its control socket, how many body
// bytes it has sent.
func originBytes(ctx context.Context, control string) (int64, error) {
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

// download is the naive baseline's downloader (inside an agent host): it
// prints "ready", waits until its stdin is closed, then downloads url,
// hashing it on the way, and fails unless it got size bytes whose sha256 is
// want (hex).
func download(url, want string, size int64, timeout time.Duration) error {
	fmt.Println("ready")
	if _, err := io.Copy(io.Discard, os.Stdin); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	h := sha256.New()
	n, err := io.CopyBuffer(h, resp.Body, make([]byte, 1<<20))
	if err != nil {
		return fmt.Errorf("GET %s: after %d bytes: %w", url, n, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); n != size || got != want {
		return fmt.Errorf("GET %s: %d bytes of sha256 %s, want %d of %s", url, n, got, size, want)
	}
	return nil
}
