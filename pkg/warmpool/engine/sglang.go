package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
)

// sglang drives SGLang's runtime LoRA API (the server runs with
// --enable-lora, and --max-lora-rank / --lora-target-modules wide enough for
// the adapters it will be given):
//
//	POST /load_lora_adapter   {"lora_name", "lora_path", "pinned"}
//	POST /unload_lora_adapter {"lora_name"}
//	GET  /v1/models   adapters carry parent (the served model) and root (their path)
//	GET  /health
//
// Load and unload answer 200 or 400 with {"success", "error_message",
// "loaded_adapters"}, where loaded_adapters maps each name to its path
// (older releases) or to a LoRARef object {"lora_id", "lora_name",
// "lora_path", "pinned"} (newer ones). The driver lists adapters through
// /v1/models, the documented listing.
type sglang struct{ server }

// NewSGLang returns the driver for the SGLang server at endpoint; see New.
func NewSGLang(endpoint string, client *http.Client) (Driver, error) {
	s, err := newServer(endpoint, client)
	if err != nil {
		return nil, err
	}
	return sglang{s}, nil
}

func (sglang) Kind() Kind { return SGLang }

func (s sglang) Health(ctx context.Context) error { return s.health(ctx) }

func (s sglang) Adapters(ctx context.Context) ([]Adapter, error) { return s.adapters(ctx) }

func (s sglang) Load(ctx context.Context, name, path string, pinned bool) error {
	r, err := s.do(ctx, http.MethodPost, "/load_lora_adapter", map[string]any{"lora_name": name, "lora_path": path, "pinned": pinned})
	if err != nil {
		return fmt.Errorf("loading adapter %q: %w", name, err)
	}
	if err := sglangError(r, false); err != nil {
		return fmt.Errorf("loading adapter %q: %w", name, err)
	}
	return nil
}

func (s sglang) Unload(ctx context.Context, name string) error {
	r, err := s.do(ctx, http.MethodPost, "/unload_lora_adapter", map[string]string{"lora_name": name})
	if err != nil {
		return fmt.Errorf("unloading adapter %q: %w", name, err)
	}
	if err := sglangError(r, true); err != nil {
		return fmt.Errorf("unloading adapter %q: %w", name, err)
	}
	return nil
}

// sglangUpdate is SGLang's LoRAUpdateOutput.
type sglangUpdate struct {
	Success        *bool                      `json:"success"`
	ErrorMessage   *string                    `json:"error_message"`
	LoadedAdapters map[string]json.RawMessage `json:"loaded_adapters"`
}

// decodeSGLangUpdate decodes a load or unload reply, checking that every
// entry of loaded_adapters is a path or a LoRARef.
func decodeSGLangUpdate(body []byte) (ok bool, msg string, err error) {
	var u sglangUpdate
	if err := json.Unmarshal(body, &u); err != nil {
		return false, "", fmt.Errorf("decoding the reply: %v: %w", err, ErrUnavailable)
	}
	if u.Success == nil {
		return false, "", fmt.Errorf("reply without success: %w", ErrUnavailable)
	}
	if u.ErrorMessage != nil {
		msg = *u.ErrorMessage
	}
	if len(u.LoadedAdapters) > maxModels {
		return false, "", fmt.Errorf("reply lists %d adapters, over %d: %w", len(u.LoadedAdapters), maxModels, ErrUnavailable)
	}
	for name, raw := range u.LoadedAdapters {
		var path string
		var ref struct {
			LoRAPath string `json:"lora_path"`
		}
		if json.Unmarshal(raw, &path) != nil && json.Unmarshal(raw, &ref) != nil {
			return false, "", fmt.Errorf("loaded adapter %q: neither a path nor a LoRARef: %w", name, ErrUnavailable)
		}
	}
	return *u.Success, msg, nil
}

// sglangError maps a reply of load or unload onto the error sentinels.
func sglangError(r response, unload bool) error {
	if r.status != http.StatusOK && (r.status < 400 || r.status >= 500) {
		return fmt.Errorf("status %d: %s: %w", r.status, quote(r.body), ErrUnavailable)
	}
	if r.status == http.StatusNotFound || r.status == http.StatusMethodNotAllowed {
		return fmt.Errorf("status %d %s: %w", r.status, quote(r.body), ErrUnsupported)
	}
	ok, msg, err := decodeSGLangUpdate(r.body)
	if err != nil {
		if r.status != http.StatusOK {
			// FastAPI's own replies (422 for a malformed request) have
			// another shape.
			return fmt.Errorf("status %d: %s: %w", r.status, quote(r.body), ErrRejected)
		}
		return err
	}
	if ok && r.status == http.StatusOK {
		return nil
	}
	q := quote([]byte(msg))
	switch {
	case strings.Contains(msg, "LoRA is not enabled"):
		return fmt.Errorf("%s: %w", q, ErrUnsupported)
	case !unload && strings.Contains(msg, "already loaded"):
		return fmt.Errorf("%s: %w", q, ErrAlreadyLoaded)
	case unload && strings.Contains(msg, "does not exist"):
		return fmt.Errorf("%s: %w", q, ErrNotLoaded)
	case ok:
		return fmt.Errorf("success with status %d: %w", r.status, ErrUnavailable)
	default:
		return fmt.Errorf("status %d: %s: %w", r.status, q, ErrRejected)
	}
}
