package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
)

// vllm drives vLLM's runtime LoRA API (served when the server runs with
// --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True):
//
//	POST /v1/load_lora_adapter   {"lora_name", "lora_path"}  200 text/plain "Success: ..."
//	POST /v1/unload_lora_adapter {"lora_name"}               200 text/plain "Success: ..."
//	GET  /v1/models   adapters carry parent (their base) and root (their path)
//	GET  /health
//
// Errors are JSON, 400 or 404, in the flat shape of older releases
// ({"object":"error","message","type","param","code"}) or the nested one of
// newer ones ({"error":{"message","type","param","code"}}). Without the
// environment flag the routes do not exist: FastAPI answers 404
// {"detail":"Not Found"}.
type vllm struct{ server }

// NewVLLM returns the driver for the vLLM server at endpoint; see New.
func NewVLLM(endpoint string, client *http.Client) (Driver, error) {
	s, err := newServer(endpoint, client)
	if err != nil {
		return nil, err
	}
	return vllm{s}, nil
}

func (vllm) Kind() Kind { return VLLM }

func (v vllm) Health(ctx context.Context) error { return v.health(ctx) }

func (v vllm) Adapters(ctx context.Context) ([]Adapter, error) { return v.adapters(ctx) }

// Load loads the adapter; vLLM has no pinning, so pinned is ignored.
func (v vllm) Load(ctx context.Context, name, path string, _ bool) error {
	r, err := v.do(ctx, http.MethodPost, "/v1/load_lora_adapter", map[string]string{"lora_name": name, "lora_path": path})
	if err != nil {
		return fmt.Errorf("loading adapter %q: %w", name, err)
	}
	if err := vllmError(r, false); err != nil {
		return fmt.Errorf("loading adapter %q: %w", name, err)
	}
	return nil
}

func (v vllm) Unload(ctx context.Context, name string) error {
	r, err := v.do(ctx, http.MethodPost, "/v1/unload_lora_adapter", map[string]string{"lora_name": name})
	if err != nil {
		return fmt.Errorf("unloading adapter %q: %w", name, err)
	}
	if err := vllmError(r, true); err != nil {
		return fmt.Errorf("unloading adapter %q: %w", name, err)
	}
	return nil
}

// vllmErrorBody holds both error shapes.
type vllmErrorBody struct {
	vllmErrorInfo
	Error *vllmErrorInfo `json:"error"`
}

type vllmErrorInfo struct {
	Message *string `json:"message"`
	Type    string  `json:"type"`
}

// decodeVLLMError returns the message and type of a vLLM error body in
// either shape; ok is false when body is neither.
func decodeVLLMError(body []byte) (msg, typ string, ok bool) {
	var e vllmErrorBody
	// A nested error whose "error" is not an object fails to decode; so
	// does anything that is not a JSON object.
	if json.Unmarshal(body, &e) != nil {
		return "", "", false
	}
	if e.Error != nil && e.Error.Message != nil {
		return *e.Error.Message, e.Error.Type, true
	}
	if e.Message != nil {
		return *e.Message, e.Type, true
	}
	return "", "", false
}

// vllmError maps a reply of load or unload onto the error sentinels; nil for
// a 200 (whose body is a plain-text success line).
func vllmError(r response, unload bool) error {
	if r.status == http.StatusOK {
		return nil
	}
	if r.status < 400 || r.status >= 500 {
		return fmt.Errorf("status %d: %s: %w", r.status, quote(r.body), ErrUnavailable)
	}
	msg, typ, ok := decodeVLLMError(r.body)
	if !ok {
		if r.status == http.StatusNotFound || r.status == http.StatusMethodNotAllowed {
			// The route is missing: runtime LoRA updating is off.
			return fmt.Errorf("status %d %s: %w", r.status, quote(r.body), ErrUnsupported)
		}
		return fmt.Errorf("status %d: %s: %w", r.status, quote(r.body), ErrRejected)
	}
	switch {
	case strings.Contains(msg, "already been loaded"):
		return fmt.Errorf("%s: %w", quote([]byte(msg)), ErrAlreadyLoaded)
	case unload && (r.status == http.StatusNotFound || typ == "NotFoundError"):
		return fmt.Errorf("%s: %w", quote([]byte(msg)), ErrNotLoaded)
	default:
		return fmt.Errorf("status %d %s: %s: %w", r.status, typ, quote([]byte(msg)), ErrRejected)
	}
}
