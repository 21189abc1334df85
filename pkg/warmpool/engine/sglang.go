package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
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
// (older releases) or to a LoRARef, an object {"lora_id", "lora_name",
// "lora_path", "pinned"} or, msgspec's array_like encoding of it
// (python/sglang/srt/lora/lora_registry.py), [lora_id, lora_name,
// lora_path, pinned, …].
//
// Releases before late 2025 list only the base model in /v1/models. The
// driver lists adapters from /v1/models once it has seen the server list
// one there; until then, a listing without adapters is answered from what
// this driver loaded (a load whose answer's loaded_adapters holds it, or
// refused as a duplicate) and has not unloaded since, forgotten when the
// server stops answering its health check (it may come back empty).
// Answers to concurrent calls may arrive in any order, so each answer
// changes only its own adapter's entry.
type sglang struct {
	server

	mu sync.Mutex
	// loaded maps what this driver loaded to its path.
	loaded map[string]string
	// lists: /v1/models has listed an adapter, so it lists them all.
	lists bool
}

// NewSGLang returns the driver for the SGLang server at endpoint; see New.
func NewSGLang(endpoint string, client *http.Client) (Driver, error) {
	s, err := newServer(endpoint, client)
	if err != nil {
		return nil, err
	}
	return &sglang{server: s}, nil
}

func (*sglang) Kind() Kind { return SGLang }

func (s *sglang) Health(ctx context.Context) error {
	err := s.health(ctx)
	if err != nil {
		s.mu.Lock()
		s.loaded = nil
		s.mu.Unlock()
	}
	return err
}

func (s *sglang) Adapters(ctx context.Context) ([]Adapter, error) {
	listed, err := s.adapters(ctx)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(listed) > 0 {
		s.lists = true
	}
	if s.lists || len(s.loaded) == 0 {
		return listed, nil
	}
	as := make([]Adapter, 0, len(s.loaded))
	for name, path := range s.loaded {
		as = append(as, Adapter{Name: name, Path: path})
	}
	return as, nil
}

func (s *sglang) Load(ctx context.Context, name, path string, pinned bool) error {
	r, err := s.do(ctx, http.MethodPost, "/load_lora_adapter", map[string]any{"lora_name": name, "lora_path": path, "pinned": pinned})
	if err != nil {
		return fmt.Errorf("loading adapter %q: %w", name, err)
	}
	loaded, err := sglangError(r, false)
	if _, ok := loaded[name]; err == nil && !ok {
		// A success whose answer does not hold the adapter is no load.
		err = fmt.Errorf("success without the adapter in loaded_adapters: %w", ErrUnavailable)
	}
	if err == nil || errors.Is(err, ErrAlreadyLoaded) {
		s.mu.Lock()
		if s.loaded == nil {
			s.loaded = map[string]string{}
		}
		if p, ok := loaded[name]; ok {
			path = p
		}
		s.loaded[name] = path
		s.mu.Unlock()
	}
	if err != nil {
		return fmt.Errorf("loading adapter %q: %w", name, err)
	}
	return nil
}

func (s *sglang) Unload(ctx context.Context, name string) error {
	r, err := s.do(ctx, http.MethodPost, "/unload_lora_adapter", map[string]string{"lora_name": name})
	if err != nil {
		return fmt.Errorf("unloading adapter %q: %w", name, err)
	}
	_, err = sglangError(r, true)
	if err == nil || errors.Is(err, ErrNotLoaded) {
		s.mu.Lock()
		delete(s.loaded, name)
		s.mu.Unlock()
	}
	if err != nil {
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

// decodeSGLangUpdate decodes a load or unload reply. loaded maps each name
// of loaded_adapters to its path (nil when the reply has none); every entry
// must be a path or a LoRARef.
func decodeSGLangUpdate(body []byte) (ok bool, msg string, loaded map[string]string, err error) {
	var u sglangUpdate
	if err := json.Unmarshal(body, &u); err != nil {
		return false, "", nil, fmt.Errorf("decoding the reply: %v: %w", err, ErrUnavailable)
	}
	if u.Success == nil {
		return false, "", nil, fmt.Errorf("reply without success: %w", ErrUnavailable)
	}
	if u.ErrorMessage != nil {
		msg = *u.ErrorMessage
	}
	if len(u.LoadedAdapters) > maxModels {
		return false, "", nil, fmt.Errorf("reply lists %d adapters, over %d: %w", len(u.LoadedAdapters), maxModels, ErrUnavailable)
	}
	if u.LoadedAdapters != nil {
		loaded = make(map[string]string, len(u.LoadedAdapters))
	}
	for name, raw := range u.LoadedAdapters {
		path, ok := loraRefPath(raw)
		if !ok || name == "" {
			return false, "", nil, fmt.Errorf("loaded adapter %s: neither a path nor a LoRARef: %w", quote([]byte(name)), ErrUnavailable)
		}
		loaded[name] = path
	}
	return *u.Success, msg, loaded, nil
}

// loraRefPath returns the path of an entry of loaded_adapters: a path, a
// LoRARef object or a LoRARef array.
func loraRefPath(raw json.RawMessage) (string, bool) {
	var path string
	if json.Unmarshal(raw, &path) == nil {
		return path, true
	}
	var ref struct {
		LoRAPath *string `json:"lora_path"`
	}
	if json.Unmarshal(raw, &ref) == nil && ref.LoRAPath != nil {
		return *ref.LoRAPath, true
	}
	var fields []json.RawMessage
	if json.Unmarshal(raw, &fields) == nil && len(fields) >= 3 && json.Unmarshal(fields[2], &path) == nil {
		return path, true
	}
	return "", false
}

// sglangError maps a reply of load or unload onto the error sentinels, and
// returns loaded_adapters of a reply that has them.
func sglangError(r response, unload bool) (map[string]string, error) {
	if r.status != http.StatusOK && (r.status < 400 || r.status >= 500) {
		return nil, fmt.Errorf("status %d: %s: %w", r.status, quote(r.body), ErrUnavailable)
	}
	if r.status == http.StatusNotFound || r.status == http.StatusMethodNotAllowed {
		return nil, fmt.Errorf("status %d %s: %w", r.status, quote(r.body), ErrUnsupported)
	}
	ok, msg, loaded, err := decodeSGLangUpdate(r.body)
	if err != nil {
		if r.status != http.StatusOK {
			// FastAPI's own replies (422 for a malformed request) have
			// another shape.
			return nil, fmt.Errorf("status %d: %s: %w", r.status, quote(r.body), ErrRejected)
		}
		return nil, err
	}
	if ok && r.status == http.StatusOK {
		return loaded, nil
	}
	q := quote([]byte(msg))
	switch {
	case strings.Contains(msg, "LoRA is not enabled"):
		return nil, fmt.Errorf("%s: %w", q, ErrUnsupported)
	case !unload && isSGLangDuplicate(msg):
		return loaded, fmt.Errorf("%s: %w", q, ErrAlreadyLoaded)
	case unload && strings.Contains(msg, "does not exist"):
		return loaded, fmt.Errorf("%s: %w", q, ErrNotLoaded)
	case ok:
		return nil, fmt.Errorf("success with status %d: %w", r.status, ErrUnavailable)
	default:
		return nil, fmt.Errorf("status %d: %s: %w", r.status, q, ErrRejected)
	}
}

// isSGLangDuplicate reports whether msg refuses a load because the name is
// taken: "LoRA with name … already exists" (python/sglang/srt/lora/
// lora_registry.py now) or "… because it is already loaded" (older
// releases).
func isSGLangDuplicate(msg string) bool {
	return strings.Contains(msg, "already loaded") ||
		strings.HasPrefix(msg, "LoRA with name ") && strings.Contains(msg, " already exists")
}
