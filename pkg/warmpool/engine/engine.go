// Package engine drives the LoRA adapter APIs of inference servers (vLLM,
// SGLang) behind one interface, so the warm pool can load, unload and list
// adapters without knowing which runtime it talks to.
package engine

import (
	"context"
	"errors"
	"regexp"
)

// adapterNameRE is what an adapter name may be: a runtime model name and a
// directory name at once (no slash, no leading dot, bounded).
var adapterNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// ValidAdapterName reports whether name can name an adapter: 1 to 64
// letters, digits, '.', '_' or '-', starting with a letter or digit.
func ValidAdapterName(name string) bool { return adapterNameRE.MatchString(name) }

// Kind names a runtime.
type Kind string

// The runtimes weightd drives.
const (
	VLLM   Kind = "vllm"
	SGLang Kind = "sglang"
)

// Adapter is a LoRA adapter a server reports as loaded.
type Adapter struct {
	Name string
	// Path is where the server loaded it from, when the runtime says.
	Path string
	// Parent is the base model the adapter sits on, when the runtime says.
	Parent string
}

// Driver is one inference server's adapter API. Implementations are safe
// for concurrent use; every call is bounded by ctx.
type Driver interface {
	Kind() Kind
	// Health returns nil when the server answers its health check.
	Health(ctx context.Context) error
	// Load loads the adapter in directory path (readable by the server)
	// under name; pinned asks the runtime to keep it resident where it can.
	Load(ctx context.Context, name, path string, pinned bool) error
	// Unload unloads the adapter called name.
	Unload(ctx context.Context, name string) error
	// Adapters lists the adapters the server has loaded now.
	Adapters(ctx context.Context) ([]Adapter, error)
}

// Errors that drivers wrap, so callers can tell the cases apart.
var (
	// ErrUnsupported: the server does not serve the adapter API (vLLM
	// without VLLM_ALLOW_RUNTIME_LORA_UPDATING, SGLang without --enable-lora).
	ErrUnsupported = errors.New("runtime adapter API not enabled")
	// ErrNotLoaded: unloading an adapter the server does not have.
	ErrNotLoaded = errors.New("adapter not loaded")
	// ErrAlreadyLoaded: loading a name the server already has.
	ErrAlreadyLoaded = errors.New("adapter already loaded")
	// ErrRejected: the server refused the request (bad adapter, rank over
	// its maximum, no free slot); the message says why.
	ErrRejected = errors.New("rejected by the runtime")
	// ErrUnavailable: the server did not answer, timed out, failed (5xx)
	// or sent a reply that is not what its runtime sends (malformed, over
	// MaxResponseBytes).
	ErrUnavailable = errors.New("runtime unavailable")
)
