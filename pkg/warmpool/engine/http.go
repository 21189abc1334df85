package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"unicode/utf8"
)

// MaxResponseBytes bounds every response body a driver reads; a longer one
// is a failure, never read to its end.
const MaxResponseBytes = 4 << 20

// maxMessage bounds a server's message quoted in an error.
const maxMessage = 512

// New returns the driver for kind talking to the server at endpoint (an
// http or https URL with a host and no query). client carries the transport
// and any timeout; nil means a plain http.Client, bounded by each call's ctx.
func New(kind Kind, endpoint string, client *http.Client) (Driver, error) {
	switch kind {
	case VLLM:
		return NewVLLM(endpoint, client)
	case SGLang:
		return NewSGLang(endpoint, client)
	default:
		return nil, fmt.Errorf("unknown runtime kind %q", kind)
	}
}

// server is what both drivers share: a base URL and a client.
type server struct {
	base   *url.URL
	client *http.Client
}

func newServer(endpoint string, client *http.Client) (server, error) {
	u, err := url.Parse(endpoint)
	if err != nil {
		return server{}, fmt.Errorf("parsing endpoint %q: %w", endpoint, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return server{}, fmt.Errorf("endpoint %q: want http(s)://host[:port][/path]", endpoint)
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	// A copy that does not follow redirects: a runtime never redirects,
	// and a load must not be replayed to another address.
	c := http.Client{}
	if client != nil {
		c = *client
	}
	c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	return server{base: u, client: &c}, nil
}

// response is a bounded, fully read reply.
type response struct {
	status int
	body   []byte
}

// do sends one request with an optional JSON body and reads the whole reply
// (at most MaxResponseBytes). Transport failures and timeouts are
// ErrUnavailable.
func (s server) do(ctx context.Context, method, path string, body any) (response, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return response{}, fmt.Errorf("encoding the request: %w", err)
		}
		rd = bytes.NewReader(b)
	}
	u := *s.base
	u.Path += path
	req, err := http.NewRequestWithContext(ctx, method, u.String(), rd)
	if err != nil {
		return response{}, fmt.Errorf("building %s %s: %w", method, path, err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		return response{}, fmt.Errorf("%s %s: %w: %w", method, path, ErrUnavailable, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxResponseBytes+1))
	if err != nil {
		return response{}, fmt.Errorf("%s %s: reading the reply: %w: %w", method, path, ErrUnavailable, err)
	}
	if len(b) > MaxResponseBytes {
		return response{}, fmt.Errorf("%s %s: reply over %d bytes: %w", method, path, MaxResponseBytes, ErrUnavailable)
	}
	return response{status: resp.StatusCode, body: b}, nil
}

// health is the GET /health both runtimes serve: 200 when ready.
func (s server) health(ctx context.Context) error {
	r, err := s.do(ctx, http.MethodGet, "/health", nil)
	if err != nil {
		return err
	}
	if r.status != http.StatusOK {
		return fmt.Errorf("health: status %d: %w", r.status, ErrUnavailable)
	}
	return nil
}

// adapters lists the adapters of GET /v1/models, which vLLM and SGLang
// serve alike.
func (s server) adapters(ctx context.Context) ([]Adapter, error) {
	r, err := s.do(ctx, http.MethodGet, "/v1/models", nil)
	if err != nil {
		return nil, err
	}
	if r.status != http.StatusOK {
		return nil, fmt.Errorf("listing models: status %d: %s: %w", r.status, quote(r.body), ErrUnavailable)
	}
	as, err := decodeModels(r.body)
	if err != nil {
		return nil, fmt.Errorf("listing models: %w", err)
	}
	return as, nil
}

// quote renders a server's text for an error message: valid UTF-8, bounded.
func quote(b []byte) string {
	s := strings.TrimSpace(strings.ToValidUTF8(string(b), "\uFFFD"))
	if len(s) > maxMessage {
		cut := maxMessage
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return fmt.Sprintf("%q", s)
}
