package podrequest

import (
	"fmt"
	"strings"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// A warm server is an inference server pod that keeps a base model resident
// on a GPU and takes LoRA adapters at run time. It says so with a label and
// describes itself with annotations:
//
//	metadata:
//	  labels:
//	    weightd.io/warm-server: "true"
//	  annotations:
//	    weightd.io/base: hf://Qwen/Qwen2.5-7B-Instruct@main   # the base model it serves
//	    weightd.io/runtime: vllm                             # vllm or sglang
//	    weightd.io/port: "8000"                              # of its HTTP API, on the pod's IP
//	    weightd.io/adapter-slots: "4"                        # vLLM --max-loras, SGLang --max-loras-per-batch
//	    weightd.io/max-lora-rank: "64"                       # optional: vLLM --max-lora-rank
//
// The agent writes the adapters it has loaded there into the
// nodestate.LoadedAdaptersAnnotation of the server pod.
const (
	// WarmServerLabel, "true", marks a pod as a warm server.
	WarmServerLabel = "weightd.io/warm-server"
	// WarmBase is the reference of the base model the server keeps resident.
	WarmBase = "weightd.io/base"
	// WarmRuntime is the server's runtime: engine.VLLM or engine.SGLang.
	WarmRuntime = "weightd.io/runtime"
	// WarmPort is the port of the server's HTTP API on the pod's IP.
	WarmPort = "weightd.io/port"
	// WarmSlots is the most adapters the server holds at once.
	WarmSlots = "weightd.io/adapter-slots"
	// WarmMaxRank, optional, is the largest LoRA rank the server takes.
	WarmMaxRank = "weightd.io/max-lora-rank"
)

// A pod that needs a LoRA adapter on a base model asks with annotations, and
// the agent of its node answers on the same pod:
//
//	metadata:
//	  annotations:
//	    weightd.io/lora-base: hf://Qwen/Qwen2.5-7B-Instruct@main   # a base some warm server of the node serves
//	    weightd.io/lora-adapter: hf://org/my-adapter@v3            # the adapter
//	    weightd.io/lora-name: my-adapter                           # optional: the model name to serve it as
//	    # written by the agent:
//	    weightd.io/lora-endpoint: http://10.0.3.7:8000             # the warm server to send requests to
//	    weightd.io/lora-model: my-adapter                          # the model name to use there
//	    weightd.io/lora-error: "…"                                 # instead of the two above, why it failed
const (
	// LoraBase is the reference of the base model the adapter sits on.
	LoraBase = "weightd.io/lora-base"
	// LoraAdapter is the reference of the adapter.
	LoraAdapter = "weightd.io/lora-adapter"
	// LoraName, optional, is the model name to serve the adapter as; the
	// warm pool derives one from the adapter's reference without it.
	LoraName = "weightd.io/lora-name"
	// LoraEndpoint is the agent's answer: the base URL of the warm server
	// (http://ip:port).
	LoraEndpoint = "weightd.io/lora-endpoint"
	// LoraModel is the agent's answer: the model name to send requests to.
	LoraModel = "weightd.io/lora-model"
	// LoraError is the agent's answer when the adapter could not be made
	// available (it replaces LoraEndpoint and LoraModel).
	LoraError = "weightd.io/lora-error"
)

// Bounds of the warm annotations.
const (
	MaxAdapterSlots = 256
	MaxLoraRank     = 4096
)

// WarmServer is a warm server as its pod's annotations describe it.
type WarmServer struct {
	Base    ref.Ref
	Runtime engine.Kind
	Port    int
	Slots   int
	// MaxRank is 0 when the pod does not say.
	MaxRank int
}

// IsWarmServer reports whether a pod's labels mark it as a warm server.
func IsWarmServer(labels map[string]string) bool {
	return labels[WarmServerLabel] == "true"
}

// ParseWarmServer reads a warm server's description from its pod's
// annotations. Every annotation but WarmMaxRank is required. Errors name
// the annotation at fault and wrap ref.ErrInvalid for a reference that
// does not parse, content.ErrInvalid for anything else.
func ParseWarmServer(annotations map[string]string) (WarmServer, error) {
	var s WarmServer
	v, ok := annotations[WarmBase]
	if !ok {
		return WarmServer{}, fmt.Errorf("%w: annotation %s is missing", content.ErrInvalid, WarmBase)
	}
	base, err := ref.Parse(strings.TrimSpace(v))
	if err != nil {
		return WarmServer{}, fmt.Errorf("annotation %s: %w", WarmBase, err)
	}
	s.Base = base
	switch k := engine.Kind(strings.TrimSpace(annotations[WarmRuntime])); k {
	case engine.VLLM, engine.SGLang:
		s.Runtime = k
	case "":
		return WarmServer{}, fmt.Errorf("%w: annotation %s is missing", content.ErrInvalid, WarmRuntime)
	default:
		return WarmServer{}, fmt.Errorf("%w: annotation %s: %q is not %s or %s",
			content.ErrInvalid, WarmRuntime, truncate(string(k)), engine.VLLM, engine.SGLang)
	}
	if s.Port, err = parseCount(annotations, WarmPort, 1, 65535, true); err != nil {
		return WarmServer{}, err
	}
	if s.Slots, err = parseCount(annotations, WarmSlots, 1, MaxAdapterSlots, true); err != nil {
		return WarmServer{}, err
	}
	if s.MaxRank, err = parseCount(annotations, WarmMaxRank, 1, MaxLoraRank, false); err != nil {
		return WarmServer{}, err
	}
	return s, nil
}

// parseCount reads a decimal number in [lo, hi] (digits only, surrounding
// spaces allowed); 0 when the annotation is absent and not required.
func parseCount(annotations map[string]string, key string, lo, hi int, required bool) (int, error) {
	v, ok := annotations[key]
	if !ok {
		if required {
			return 0, fmt.Errorf("%w: annotation %s is missing", content.ErrInvalid, key)
		}
		return 0, nil
	}
	s := strings.TrimSpace(v)
	n := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' || n > hi {
			return 0, fmt.Errorf("%w: annotation %s: %q is not a number from %d to %d", content.ErrInvalid, key, truncate(v), lo, hi)
		}
		n = n*10 + int(c-'0')
	}
	if s == "" || n < lo || n > hi {
		return 0, fmt.Errorf("%w: annotation %s: %q is not a number from %d to %d", content.ErrInvalid, key, truncate(v), lo, hi)
	}
	return n, nil
}

// AdapterRequest is a pod's request for a LoRA adapter.
type AdapterRequest struct {
	Base    ref.Ref
	Adapter ref.Ref
	// Name is "" when the pod leaves it to the warm pool.
	Name string
}

// ParseAdapterRequest reads a pod's adapter request from its annotations;
// ok is false when the pod asks for none (it has none of LoraBase,
// LoraAdapter and LoraName). LoraBase and LoraAdapter go together; LoraName
// is a name engine.ValidAdapterName accepts (1 to 64 letters, digits, '.', '_'
// or '-', starting with a letter or digit). Errors name the annotation at
// fault and wrap ref.ErrInvalid for a reference that does not parse,
// content.ErrInvalid for anything else.
func ParseAdapterRequest(annotations map[string]string) (req AdapterRequest, ok bool, err error) {
	base, hasBase := annotations[LoraBase]
	adapter, hasAdapter := annotations[LoraAdapter]
	name, hasName := annotations[LoraName]
	if !hasBase && !hasAdapter && !hasName {
		return AdapterRequest{}, false, nil
	}
	if !hasBase || !hasAdapter {
		missing := LoraBase
		if hasBase {
			missing = LoraAdapter
		}
		return AdapterRequest{}, true, fmt.Errorf("%w: annotation %s is missing (%s and %s go together)",
			content.ErrInvalid, missing, LoraBase, LoraAdapter)
	}
	if req.Base, err = ref.Parse(strings.TrimSpace(base)); err != nil {
		return AdapterRequest{}, true, fmt.Errorf("annotation %s: %w", LoraBase, err)
	}
	if req.Adapter, err = ref.Parse(strings.TrimSpace(adapter)); err != nil {
		return AdapterRequest{}, true, fmt.Errorf("annotation %s: %w", LoraAdapter, err)
	}
	if hasName {
		req.Name = strings.TrimSpace(name)
		if !engine.ValidAdapterName(req.Name) {
			return AdapterRequest{}, true, fmt.Errorf("%w: annotation %s: %q is not 1 to 64 letters, digits, '.', '_' or '-' starting with a letter or digit",
				content.ErrInvalid, LoraName, truncate(name))
		}
	}
	return req, true, nil
}
