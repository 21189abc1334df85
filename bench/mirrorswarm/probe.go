package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/weightd/weightd/internal/benchnet"
)

// probeResult is what a probe in a node measured.
type probeResult struct {
	RTTMS float64 `json:"rtt_ms"`
	GetMS float64 `json:"get_ms"`
	err   error
}

// probeSmallBlob waits half of S/B, then asks n's mirror for the small
// image's layer from inside n: the bench re-executed there (probe).
func (b *bench) probeSmallBlob(ctx context.Context, n *node) probeResult {
	select {
	case <-time.After(b.limit / 2):
	case <-ctx.Done():
		return probeResult{err: ctx.Err()}
	}
	exe, err := os.Executable()
	if err != nil {
		return probeResult{err: err}
	}
	l := b.small.Layers[0]
	url := fmt.Sprintf("http://%s/v2/bench/small/blobs/%s?ns=%s",
		netip.AddrPortFrom(n.host.Addr, benchnet.MirrorPort), l.Digest, b.reg.Addr)
	out, err := n.host.Command(ctx, exe, "-probe-url", url, "-probe-rtt", b.reg.Addr).Output()
	if err != nil {
		return probeResult{err: fmt.Errorf("probe in %s: %w", n.host.Name, err)}
	}
	var r probeResult
	if err := json.Unmarshal(out, &r); err != nil {
		return probeResult{err: fmt.Errorf("probe in %s said %q: %w", n.host.Name, out, err)}
	}
	return r
}

// probe times a TCP connect to rttAddr, then a GET of url, whose body must
// match the sha256 digest the URL ends with, and prints both in ms as JSON.
func probe(url, rttAddr string) error {
	start := time.Now()
	c, err := net.DialTimeout("tcp", rttAddr, 30*time.Second)
	if err != nil {
		return err
	}
	rtt := time.Since(start)
	c.Close()
	start = time.Now()
	resp, err := (&http.Client{Timeout: time.Minute}).Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	h := sha256.New()
	if _, err := io.Copy(h, resp.Body); err != nil {
		return err
	}
	took := time.Since(start)
	want := url[strings.LastIndex(url, "sha256:")+len("sha256:"):]
	if i := strings.IndexByte(want, '?'); i >= 0 {
		want = want[:i]
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		return fmt.Errorf("GET %s: body hashes to %s", url, got)
	}
	return json.NewEncoder(os.Stdout).Encode(probeResult{
		RTTMS: float64(rtt.Microseconds()) / 1000, GetMS: float64(took.Microseconds()) / 1000,
	})
}
