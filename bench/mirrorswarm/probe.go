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
	RTTMS      float64 `json:"rtt_ms"`
	GetMS      float64 `json:"get_ms"`
	ManifestMS float64 `json:"manifest_ms"`
	err        error
}

// probeSmallBlob waits half of S/B, then asks n's mirror for the small
// image's layer and the tagged image's manifest from inside n: the bench
// re-executed there (probe).
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
	mirror := netip.AddrPortFrom(n.host.Addr, benchnet.MirrorPort)
	manifest := fmt.Sprintf("http://%s/v2/bench/tagged/manifests/v1?ns=%s", mirror, b.reg.Addr)
	out, err := n.host.Command(ctx, exe, "-probe-url", url, "-probe-manifest-url", manifest, "-probe-rtt", b.reg.Addr).Output()
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
// match the sha256 digest the URL ends with, then one of manifestURL, whose
// body must match the digest it comes with, and prints the three in ms as
// JSON.
func probe(url, manifestURL, rttAddr string) error {
	start := time.Now()
	c, err := net.DialTimeout("tcp", rttAddr, 30*time.Second)
	if err != nil {
		return err
	}
	rtt := time.Since(start)
	c.Close()
	want := url[strings.LastIndex(url, "sha256:")+len("sha256:"):]
	if i := strings.IndexByte(want, '?'); i >= 0 {
		want = want[:i]
	}
	client := &http.Client{Timeout: time.Minute}
	blob, err := timedGet(client, url, "", want)
	if err != nil {
		return err
	}
	manifest, err := timedGet(client, manifestURL, "application/vnd.oci.image.manifest.v1+json", "")
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(probeResult{
		RTTMS: ms(rtt), GetMS: ms(blob), ManifestMS: ms(manifest),
	})
}

// timedGet GETs url (with accept, if given) and times it to the last byte
// of its body, whose sha256 must be want, or where want is empty the
// Docker-Content-Digest it comes with.
func timedGet(client *http.Client, url, accept, want string) (time.Duration, error) {
	start := time.Now()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	h := sha256.New()
	if _, err := io.Copy(h, resp.Body); err != nil {
		return 0, err
	}
	took := time.Since(start)
	if want == "" {
		want = strings.TrimPrefix(resp.Header.Get("Docker-Content-Digest"), "sha256:")
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		return 0, fmt.Errorf("GET %s: body hashes to %s, not %s", url, got, want)
	}
	return took, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
