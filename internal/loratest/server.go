package loratest

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/weightd/weightd/pkg/lora"
)

// Options configure a test server the way a runtime's flags do.
type Options struct {
	// Base is the served model name; "base" when empty.
	Base string
	// MaxRank is --max-lora-rank (vLLM: --max-lora-rank too); 64 when zero.
	MaxRank int
	// Slots, when positive, is vLLM's --max-loras or SGLang's
	// --max-loaded-loras. vLLM takes loads past it, keeps listing every
	// adapter and evicts from its GPU and CPU caches by LRU
	// (vllm/lora/worker_manager.py, LRUCacheWorkerLoRAManager); SGLang
	// refuses them ("Cannot load LoRA adapter … Maximum number of loaded
	// LoRA adapters is N", python/sglang/srt/managers/tokenizer_manager.py).
	Slots int
	// MaxLorasPerBatch is SGLang's --max-loras-per-batch (8 when zero):
	// at most MaxLorasPerBatch-1 adapters may be pinned
	// (python/sglang/srt/lora/lora_manager.py, validate_new_adapter).
	MaxLorasPerBatch int
	// OlderSGLang follows the SGLang releases before adapters were listed
	// in GET /v1/models (only the base is) and before the duplicate-name
	// message became "LoRA with name … already exists"
	// (python/sglang/srt/lora/lora_registry.py): a duplicate load then
	// answers "Failed to load LoRA adapter … because it is already loaded".
	OlderSGLang bool
	// Disabled turns the runtime adapter API off: vLLM without
	// VLLM_ALLOW_RUNTIME_LORA_UPDATING (the routes answer 404
	// {"detail":"Not Found"}), SGLang without --enable-lora (400 "LoRA is
	// not enabled").
	Disabled bool
	// NestedErrors makes the vLLM server answer errors in the newer nested
	// shape {"error":{...}} instead of the older flat one.
	NestedErrors bool
	// CheckBase rejects adapters whose base_model_name_or_path is not Base.
	CheckBase bool
}

type runtime int

const (
	runVLLM runtime = iota
	runSGLang
)

// maxRequestBytes bounds a request body, as the runtimes' frameworks do.
const maxRequestBytes = 1 << 20

type loaded struct {
	path   string
	pinned bool
	id     int
}

// Server is a runtime test server on loopback. Its methods are safe for
// concurrent use.
type Server struct {
	rt   runtime
	opts Options
	addr string

	mu      sync.Mutex
	srv     *http.Server
	served  chan struct{} // closed when the current Serve returns
	stop    chan struct{} // closed when the current instance stops
	adapter map[string]loaded
	nextID  int
	loads   map[string]int
	unloads map[string]int
	peak    int
	// Faults.
	delay    time.Duration
	failNext int
	lie      bool
	hang     bool
	killLoad bool
}

// NewVLLM starts a server that follows vLLM's OpenAI-compatible server with
// runtime LoRA updating.
func NewVLLM(opts Options) (*Server, error) { return start(runVLLM, opts) }

// NewSGLang starts a server that follows SGLang's HTTP server with
// --enable-lora.
func NewSGLang(opts Options) (*Server, error) { return start(runSGLang, opts) }

func start(rt runtime, opts Options) (*Server, error) {
	if opts.Base == "" {
		opts.Base = "base"
	}
	if opts.MaxRank == 0 {
		opts.MaxRank = 64
	}
	if opts.MaxLorasPerBatch == 0 {
		opts.MaxLorasPerBatch = 8
	}
	s := &Server{rt: rt, opts: opts, loads: map[string]int{}, unloads: map[string]int{}, adapter: map[string]loaded{}}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.listenLocked("127.0.0.1:0"); err != nil {
		return nil, err
	}
	return s, nil
}

// listenLocked starts a fresh instance on addr.
func (s *Server) listenLocked(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", addr, err)
	}
	s.addr = ln.Addr().String()
	stop := make(chan struct{})
	srv := &http.Server{Handler: s.handler(stop), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	s.srv, s.stop, s.served = srv, stop, served
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	return nil
}

// stopLocked closes the current instance (listener and connections) and
// waits for it to stop serving; idempotent.
func (s *Server) stopLocked() {
	if s.srv == nil {
		return
	}
	close(s.stop)
	_ = s.srv.Close()
	<-s.served
	s.srv = nil
}

// URL is the server's base URL, http://127.0.0.1:port.
func (s *Server) URL() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return "http://" + s.addr
}

// Close stops the server.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked()
}

// Kill stops the server abruptly, as a crashed process: the listener and
// every connection close, requests in flight get no reply. Restart brings
// it back.
func (s *Server) Kill() { s.Close() }

// Restart stops the server if it runs and starts it again on the same
// address, with no adapter loaded, as a restarted runtime comes back.
// Counters and fault settings stay.
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopLocked()
	s.adapter = map[string]loaded{}
	return s.listenLocked(s.addr)
}

// Loads is how many times name was loaded (answered with success).
func (s *Server) Loads(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loads[name]
}

// Unloads is how many times name was unloaded.
func (s *Server) Unloads(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.unloads[name]
}

// Loaded maps each loaded adapter to the path it was loaded from.
func (s *Server) Loaded() map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := make(map[string]string, len(s.adapter))
	for n, a := range s.adapter {
		m[n] = a.path
	}
	return m
}

// Peak is the most adapters ever loaded at once.
func (s *Server) Peak() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peak
}

// SetDelay delays every reply by d (0 for none).
func (s *Server) SetDelay(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.delay = d
}

// FailNext makes the next n requests fail with 500.
func (s *Server) FailNext(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failNext = n
}

// SetLie makes loads answer success without loading: the adapter is never
// listed.
func (s *Server) SetLie(lie bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lie = lie
}

// SetHang makes every request wait, unanswered, until the client gives up
// or the server stops.
func (s *Server) SetHang(hang bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.hang = hang
}

// KillOnNextLoad makes the next load request kill the server (see Kill)
// after it has been received and before it is answered.
func (s *Server) KillOnNextLoad() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLoad = true
}

func (s *Server) handler(stop <-chan struct{}) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /v1/models", s.models)
	prefix := ""
	if s.rt == runVLLM {
		prefix = "/v1"
	}
	mux.HandleFunc("POST "+prefix+"/load_lora_adapter", func(w http.ResponseWriter, r *http.Request) { s.load(w, r, stop) })
	mux.HandleFunc("POST "+prefix+"/unload_lora_adapter", func(w http.ResponseWriter, r *http.Request) { s.unload(w, r, stop) })
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		delay, hang, fail := s.delay, s.hang, s.failNext > 0
		if fail {
			s.failNext--
		}
		s.mu.Unlock()
		if hang {
			select {
			case <-r.Context().Done():
			case <-stop:
			}
			return
		}
		if delay > 0 {
			t := time.NewTimer(delay)
			defer t.Stop()
			select {
			case <-t.C:
			case <-r.Context().Done():
				return
			case <-stop:
				return
			}
		}
		if fail {
			s.fail(w, http.StatusInternalServerError, "InternalServerError", "injected failure")
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// fail writes an error the way the runtime does.
func (s *Server) fail(w http.ResponseWriter, status int, typ, msg string) {
	if s.rt == runSGLang {
		if status >= 500 {
			http.Error(w, "Internal Server Error", status)
			return
		}
		writeJSON(w, status, map[string]any{"success": false, "error_message": msg, "loaded_adapters": nil})
		return
	}
	info := map[string]any{"message": msg, "type": typ, "param": nil, "code": status}
	if s.opts.NestedErrors {
		writeJSON(w, status, map[string]any{"error": info})
		return
	}
	info["object"] = "error"
	writeJSON(w, status, info)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeText(w http.ResponseWriter, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	_, _ = io.WriteString(w, msg)
}

type request struct {
	Name   string `json:"lora_name"`
	Path   string `json:"lora_path"`
	Pinned bool   `json:"pinned"`
}

func decode(r *http.Request) (request, error) {
	var req request
	err := json.NewDecoder(io.LimitReader(r.Body, maxRequestBytes)).Decode(&req)
	return req, err
}

// disabled answers a request to the adapter API when it is off.
func (s *Server) disabled(w http.ResponseWriter) {
	if s.rt == runVLLM {
		writeJSON(w, http.StatusNotFound, map[string]string{"detail": "Not Found"})
		return
	}
	s.fail(w, http.StatusBadRequest, "", "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
}

// stopped reports whether the instance that received a request has
// stopped since; its requests then change nothing. Call with s.mu held.
func stopped(stop <-chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}

func (s *Server) load(w http.ResponseWriter, r *http.Request, stop <-chan struct{}) {
	if s.opts.Disabled {
		s.disabled(w)
		return
	}
	req, err := decode(r)
	if err != nil {
		writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"detail": err.Error()})
		return
	}
	s.mu.Lock()
	kill := s.killLoad
	s.killLoad = false
	s.mu.Unlock()
	if kill {
		s.killMidRequest(w)
		return
	}
	if req.Name == "" || req.Path == "" {
		s.fail(w, http.StatusBadRequest, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
		return
	}
	// Open the staged files as the runtime would, outside the lock.
	a, inspectErr := lora.Inspect(req.Path)

	s.mu.Lock()
	defer s.mu.Unlock()
	if stopped(stop) {
		return
	}
	if _, ok := s.adapter[req.Name]; ok {
		switch {
		case s.rt == runVLLM:
			s.fail(w, http.StatusBadRequest, "InvalidUserInput", fmt.Sprintf("The lora adapter '%s' has already been loaded.", req.Name))
		case s.opts.OlderSGLang:
			s.fail(w, http.StatusBadRequest, "", fmt.Sprintf("Failed to load LoRA adapter %s because it is already loaded", req.Name))
		default:
			s.fail(w, http.StatusBadRequest, "", fmt.Sprintf("LoRA with name %s already exists. Loaded LoRAs: odict_keys(%s)", req.Name, s.namesLocked()))
		}
		return
	}
	switch {
	case inspectErr != nil && errors.Is(inspectErr, fs.ErrNotExist) && s.rt == runVLLM:
		s.fail(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("Loading lora %s failed: No adapter found for %s", req.Name, req.Path))
		return
	case inspectErr != nil:
		s.fail(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("Loading lora %s failed: %v", req.Name, inspectErr))
		return
	case a.Rank > s.opts.MaxRank && s.rt == runVLLM:
		s.fail(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("LoRA rank %d is greater than max_lora_rank %d.", a.Rank, s.opts.MaxRank))
		return
	case a.Rank > s.opts.MaxRank:
		s.fail(w, http.StatusBadRequest, "", fmt.Sprintf("LoRA adapter %s with rank %d is incompatible with the current LoRA memory pool configuration. "+
			"Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the target modules are included in `--lora-target-modules`.", req.Name, a.Rank))
		return
	case s.opts.CheckBase && a.BaseModel != s.opts.Base:
		s.fail(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("Loading lora %s failed: adapter is for base model %q, this server serves %q", req.Name, a.BaseModel, s.opts.Base))
		return
	case s.rt == runSGLang && s.opts.Slots > 0 && len(s.adapter) >= s.opts.Slots:
		s.fail(w, http.StatusBadRequest, "", fmt.Sprintf("Cannot load LoRA adapter %s at path %s. Maximum number of loaded LoRA adapters is %d. "+
			"Please unload some LoRA adapters before loading new ones.", req.Name, req.Path, s.opts.Slots))
		return
	case s.rt == runSGLang && req.Pinned && s.pinnedLocked() >= s.opts.MaxLorasPerBatch-1:
		s.fail(w, http.StatusBadRequest, "", fmt.Sprintf("Failed to load LoRA adapter %s as a pinned adapter. It is not allowed to pin all slots "+
			"in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please increase your "+
			"`--max-loras-per-batch` or load it as unpinned LoRA adapters.", req.Name))
		return
	}
	s.loads[req.Name]++
	if !s.lie {
		s.nextID++
		s.adapter[req.Name] = loaded{path: req.Path, pinned: req.Pinned, id: s.nextID}
		s.peak = max(s.peak, len(s.adapter))
	}
	if s.rt == runVLLM {
		writeText(w, fmt.Sprintf("Success: LoRA adapter '%s' added successfully.", req.Name))
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "error_message": nil, "loaded_adapters": s.refsLocked()})
}

// killMidRequest kills the server, then drops the connection of the
// request being served, unanswered: by the time the client sees it fail,
// the server is gone.
func (s *Server) killMidRequest(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	s.Kill()
	if err == nil {
		_ = conn.Close()
	}
}

// pinnedLocked counts the adapters loaded pinned.
func (s *Server) pinnedLocked() int {
	n := 0
	for _, a := range s.adapter {
		if a.pinned {
			n++
		}
	}
	return n
}

// Pinned lists the adapters loaded pinned, sorted.
func (s *Server) Pinned() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var names []string
	for n, a := range s.adapter {
		if a.pinned {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names
}

// refsLocked is SGLang's loaded_adapters: name to LoRARef.
func (s *Server) refsLocked() map[string]any {
	m := make(map[string]any, len(s.adapter))
	for n, a := range s.adapter {
		m[n] = map[string]any{"lora_id": fmt.Sprintf("%032x", a.id), "lora_name": n, "lora_path": a.path, "pinned": a.pinned}
	}
	return m
}

func (s *Server) unload(w http.ResponseWriter, r *http.Request, stop <-chan struct{}) {
	if s.opts.Disabled {
		s.disabled(w)
		return
	}
	req, err := decode(r)
	if err != nil {
		writeJSON(w, http.StatusUnprocessableEntity, map[string]string{"detail": err.Error()})
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if stopped(stop) {
		return
	}
	if req.Name == "" {
		s.fail(w, http.StatusBadRequest, "InvalidUserInput", "either 'lora_name' and 'lora_int_id' needs to be provided.")
		return
	}
	if _, ok := s.adapter[req.Name]; !ok {
		if s.rt == runVLLM {
			s.fail(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The lora adapter '%s' cannot be found.", req.Name))
		} else {
			s.fail(w, http.StatusBadRequest, "", fmt.Sprintf("LoRA with name %s does not exist. Loaded LoRAs: dict_keys(%s)", req.Name, s.namesLocked()))
		}
		return
	}
	delete(s.adapter, req.Name)
	s.unloads[req.Name]++
	if s.rt == runVLLM {
		writeText(w, fmt.Sprintf("Success: LoRA adapter '%s' removed successfully.", req.Name))
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "error_message": nil, "loaded_adapters": s.refsLocked()})
}

// namesLocked renders the loaded names as Python prints a list of strings.
func (s *Server) namesLocked() string {
	names := make([]string, 0, len(s.adapter))
	for n := range s.adapter {
		names = append(names, "'"+n+"'")
	}
	sort.Strings(names)
	return "[" + strings.Join(names, ", ") + "]"
}

// models answers GET /v1/models: the base, then the adapters with parent
// and root.
func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	owner := "vllm"
	if s.rt == runSGLang {
		owner = "sglang"
	}
	now := time.Now().Unix()
	card := func(id, root string, parent any, maxLen any) map[string]any {
		c := map[string]any{"id": id, "object": "model", "created": now, "owned_by": owner, "root": root, "parent": parent, "max_model_len": maxLen}
		if s.rt == runVLLM {
			c["permission"] = []map[string]any{{
				"id": "modelperm-" + id, "object": "model_permission", "created": now,
				"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
				"allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
				"organization": "*", "group": nil, "is_blocking": false,
			}}
		}
		return c
	}
	data := []map[string]any{card(s.opts.Base, s.opts.Base, nil, 4096)}
	if s.rt == runSGLang && s.opts.OlderSGLang {
		writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
		return
	}
	names := make([]string, 0, len(s.adapter))
	for n := range s.adapter {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool { return s.adapter[names[i]].id < s.adapter[names[j]].id })
	for _, n := range names {
		data = append(data, card(n, s.adapter[n].path, s.opts.Base, nil))
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}
