package api

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/weightd/weightd/pkg/prefetch"
)

// ErrNotFound matches (with errors.Is) an *Error for an unknown job or route.
var ErrNotFound = errors.New("not found")

// Error is an error answer of the server: its HTTP status and its message.
type Error struct {
	StatusCode int
	Message    string
}

func (e *Error) Error() string {
	return fmt.Sprintf("agent: %s (HTTP %d)", e.Message, e.StatusCode)
}

// Is makes errors.Is(err, ErrNotFound) true for a 404 answer,
// ErrBadRequest for a 400 and ErrBusy for a 409.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return e.StatusCode == http.StatusNotFound
	case ErrBadRequest:
		return e.StatusCode == http.StatusBadRequest
	case ErrBusy:
		return e.StatusCode == http.StatusConflict
	}
	return false
}

// Client talks to an agent's API.
type Client struct {
	base string // "http://host:port" or "http://weightd" for a unix socket
	hc   *http.Client
}

// NewClient returns a client of the agent at addr: "unix:///path/to.sock",
// "http://127.0.0.1:port" or "tcp://127.0.0.1:port".
func NewClient(addr string) (*Client, error) {
	network, address, err := ParseAddr(addr)
	if err != nil {
		return nil, err
	}
	dialer := &net.Dialer{Timeout: 5 * time.Second}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, address)
		},
		MaxIdleConns:          4,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: 30 * time.Second,
	}
	base := "http://" + address
	if network == "unix" {
		base = "http://weightd"
	}
	return &Client{base: base, hc: &http.Client{Transport: tr}}, nil
}

// Fetch submits a fetch of ref at normal priority and returns the job's
// first status.
func (c *Client) Fetch(ctx context.Context, ref string) (prefetch.JobStatus, error) {
	return c.Submit(ctx, FetchRequest{Ref: ref})
}

// Submit submits a fetch and returns the job's first status.
func (c *Client) Submit(ctx context.Context, req FetchRequest) (prefetch.JobStatus, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return prefetch.JobStatus{}, err
	}
	var st prefetch.JobStatus
	err = c.do(ctx, http.MethodPost, "/v1/fetch", bytes.NewReader(body), &st)
	return st, err
}

// Cancel cancels job id and returns its status of the moment.
func (c *Client) Cancel(ctx context.Context, id string) (prefetch.JobStatus, error) {
	var st prefetch.JobStatus
	err := c.do(ctx, http.MethodDelete, "/v1/fetch/"+url.PathEscape(id), nil, &st)
	return st, err
}

// Job returns the status of job id.
func (c *Client) Job(ctx context.Context, id string) (prefetch.JobStatus, error) {
	var st prefetch.JobStatus
	err := c.do(ctx, http.MethodGet, "/v1/fetch/"+url.PathEscape(id), nil, &st)
	return st, err
}

// Jobs returns the status of every job the agent remembers.
func (c *Client) Jobs(ctx context.Context) ([]prefetch.JobStatus, error) {
	var list []prefetch.JobStatus
	err := c.do(ctx, http.MethodGet, "/v1/fetch", nil, &list)
	return list, err
}

// Status returns the agent's version, cache usage and jobs.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var st Status
	err := c.do(ctx, http.MethodGet, "/v1/status", nil, &st)
	return st, err
}

// Ready returns nil when the agent answers GET /readyz with 200.
func (c *Client) Ready(ctx context.Context) error {
	return c.do(ctx, http.MethodGet, "/readyz", nil, nil)
}

// WaitReady polls Ready until the agent is ready; if ctx ends first it
// returns why the agent was not ready (or could not be reached).
func (c *Client) WaitReady(ctx context.Context) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var why error
	for {
		err := c.Ready(ctx)
		if err == nil {
			return nil
		}
		if ctx.Err() == nil || why == nil {
			why = err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the agent: %w", why)
		case <-tick.C:
		}
	}
}

// Watch calls fn with each status of job id, in order, until the job ends,
// and returns its final status. It returns an error if ctx ends first or the
// stream breaks before the job has ended.
func (c *Client) Watch(ctx context.Context, id string, fn func(prefetch.JobStatus)) (prefetch.JobStatus, error) {
	resp, err := c.send(ctx, http.MethodGet, "/v1/fetch/"+url.PathEscape(id)+"/watch", nil)
	if err != nil {
		return prefetch.JobStatus{}, err
	}
	defer resp.Body.Close()
	var last prefetch.JobStatus
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), MaxBodyBytes)
	for sc.Scan() {
		var st prefetch.JobStatus
		if err := json.Unmarshal(sc.Bytes(), &st); err != nil {
			return last, fmt.Errorf("watching job %s: decoding status: %w", id, err)
		}
		last = st
		if fn != nil {
			fn(st)
		}
	}
	if err := sc.Err(); err != nil {
		if ctx.Err() != nil {
			return last, ctx.Err()
		}
		return last, fmt.Errorf("watching job %s: %w", id, err)
	}
	if ctx.Err() != nil {
		return last, ctx.Err()
	}
	if !last.State.Finished() {
		return last, fmt.Errorf("watching job %s: stream ended in state %q", id, last.State)
	}
	return last, nil
}

// do sends a request and decodes a 2xx JSON answer into out (if not nil).
func (c *Client) do(ctx context.Context, method, path string, body io.Reader, out any) error {
	resp, err := c.send(ctx, method, path, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, MaxBodyBytes))
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("%s %s: decoding answer: %w", method, path, err)
	}
	return nil
}

// send sends a request and returns a 2xx response; any other answer becomes
// an *Error carrying the server's message.
func (c *Client) send(ctx context.Context, method, path string, body io.Reader) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var eb errorBody
	msg := strings.TrimSpace(string(raw))
	if json.Unmarshal(raw, &eb) == nil && eb.Error != "" {
		msg = eb.Error
	}
	if msg == "" {
		msg = http.StatusText(resp.StatusCode)
	}
	return nil, &Error{StatusCode: resp.StatusCode, Message: msg}
}
