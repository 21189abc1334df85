package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

// The bench re-executes itself inside the testbed's hosts for the programs
// that must run there: the origin (benchnet.ServeOrigin) and the naive
// downloader.

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
