package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// GPU is one GPU of the node as the agent's NVML inventory sees it.
type GPU struct {
	Index            int    `json:"index"`
	UUID             string `json:"uuid"`
	Name             string `json:"name"`
	MemoryTotalBytes uint64 `json:"memoryTotalBytes"`
	MemoryUsedBytes  uint64 `json:"memoryUsedBytes"`
	// Bases are the warm bases resident on this GPU.
	Bases []string `json:"bases,omitempty"`
}

// WarmServer is an inference server on this node that keeps a base model
// resident and takes LoRA adapters.
type WarmServer struct {
	// Pod is namespace/name of the server's pod.
	Pod      string `json:"pod"`
	Base     string `json:"base"`
	Runtime  string `json:"runtime"`
	Endpoint string `json:"endpoint"`
	Healthy  bool   `json:"healthy"`
	Error    string `json:"error,omitempty"`
	Slots    int    `json:"slots"`
	// GPUs are the UUIDs of the GPUs the server's processes use.
	GPUs     []string        `json:"gpus,omitempty"`
	Adapters []LoadedAdapter `json:"adapters"`
}

// LoadedAdapter is an adapter loaded in a warm server.
type LoadedAdapter struct {
	Name     string    `json:"name"`
	Ref      string    `json:"ref,omitempty"`
	LastUsed time.Time `json:"lastUsed"`
	Pinned   bool      `json:"pinned,omitempty"`
	InUse    int       `json:"inUse,omitempty"`
}

// ModelLoad is how long a pod's processes spent reading a model's files,
// from the first open to the last close, as the load tracer saw it.
type ModelLoad struct {
	Pod     string    `json:"pod,omitempty"`
	Model   string    `json:"model"`
	Started time.Time `json:"started"`
	Seconds float64   `json:"seconds"`
	Files   int       `json:"files"`
	Open    int       `json:"open"`
	Order   []string  `json:"order,omitempty"`
}

// AdapterRequest is the body of POST /v1/adapters: make adapter Ref
// available under Name on a warm server of Base.
type AdapterRequest struct {
	Base string `json:"base"`
	Ref  string `json:"ref"`
	// Name is the model name clients will use; empty derives one from Ref.
	Name string `json:"name,omitempty"`
	// Pin keeps the adapter from eviction until it is unpinned.
	Pin bool `json:"pin,omitempty"`
	// Namespace, when set, is the namespace of the pod that asks: only warm
	// servers of that namespace, or shared ones, serve it. The agent's
	// Kubernetes side sets it; it is never read from a request body (a
	// caller of the node's local API may use any server).
	Namespace string `json:"-"`
}

// AdapterAnswer says where an ensured adapter is served.
type AdapterAnswer struct {
	// Server is namespace/name of the warm server's pod.
	Server string `json:"server"`
	// Endpoint is the server's base URL (http://ip:port).
	Endpoint string `json:"endpoint"`
	// Model is the model name to send requests to.
	Model string `json:"model"`
	// Loaded is true when this request loaded it, false when it was already there.
	Loaded  bool    `json:"loaded"`
	Seconds float64 `json:"seconds"`
}

// Adapters is what the server needs of the warm pool for POST /v1/adapters.
// Errors wrapping ErrBadRequest answer 400, ErrNotFound 404 and ErrBusy
// 409; others 502.
type Adapters interface {
	Ensure(ctx context.Context, req AdapterRequest) (AdapterAnswer, error)
}

// Errors an Adapters implementation wraps to choose the status code; the
// client's *Error matches them (errors.Is) by status code too.
var (
	ErrBadRequest = errors.New("bad request")
	ErrBusy       = errors.New("busy")
)

// WithGPUs sets where GET /v1/status learns the node's GPUs.
func WithGPUs(gpus func() []GPU) Option {
	return func(s *Server) error { s.gpus = gpus; return nil }
}

// WithWarmServers sets where GET /v1/status learns the warm servers.
func WithWarmServers(servers func() []WarmServer) Option {
	return func(s *Server) error { s.warm = servers; return nil }
}

// WithModelLoads sets where GET /v1/status learns recent model loads.
func WithModelLoads(loads func() []ModelLoad) Option {
	return func(s *Server) error { s.loads = loads; return nil }
}

// WithAdapters serves POST /v1/adapters from a.
func WithAdapters(a Adapters) Option {
	return func(s *Server) error {
		if a == nil {
			return errors.New("api: nil adapters")
		}
		s.adapters = a
		return nil
	}
}

func (s *Server) ensureAdapter(w http.ResponseWriter, r *http.Request) {
	if s.adapters == nil {
		writeError(w, http.StatusNotFound, "this agent has no warm pool")
		return
	}
	var req AdapterRequest
	if !decodeBody(w, r, &req) {
		return
	}
	if req.Base == "" || req.Ref == "" {
		writeError(w, http.StatusBadRequest, "fields base and ref are required")
		return
	}
	ans, err := s.adapters.Ensure(r.Context(), req)
	switch {
	case errors.Is(err, ErrBadRequest):
		writeError(w, http.StatusBadRequest, err.Error())
	case errors.Is(err, ErrNotFound):
		writeError(w, http.StatusNotFound, err.Error())
	case errors.Is(err, ErrBusy):
		writeError(w, http.StatusConflict, err.Error())
	case err != nil:
		s.log.Warn("ensuring adapter", "base", req.Base, "ref", req.Ref, "err", err)
		writeError(w, http.StatusBadGateway, err.Error())
	default:
		writeJSON(w, http.StatusOK, ans)
	}
}

// EnsureAdapter asks the agent to make an adapter available on a warm
// server of its base, and waits until it is loaded.
func (c *Client) EnsureAdapter(ctx context.Context, req AdapterRequest) (AdapterAnswer, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return AdapterAnswer{}, fmt.Errorf("encoding request: %w", err)
	}
	var ans AdapterAnswer
	err = c.do(ctx, http.MethodPost, "/v1/adapters", bytes.NewReader(b), &ans)
	return ans, err
}
