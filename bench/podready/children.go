package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

// The bench re-executes itself inside the testbed's hosts for what must run
// there: the origin (benchnet.ServeOrigin), and reading an agent's /metrics.

// printURL copies the body of GET url to stdout (inside an agent's host).
func printURL(url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
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
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}
