package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

// MaxBodyBytes bounds a request body.
const MaxBodyBytes = 1 << 20

// Jobs is what the server needs of the prefetch queue. QueueJobs adapts a
// *prefetch.Queue.
type Jobs interface {
	// Submit starts (or joins) a fetch of ref at priority p. An error
	// wrapping ref.ErrInvalid means the reference itself is wrong.
	Submit(ref string, p prefetch.Priority) (prefetch.JobStatus, error)
	// Cancel cancels the job and returns its status, or false for an
	// unknown id.
	Cancel(id string) (prefetch.JobStatus, bool)
	// Status returns the job's current status, or false for an unknown id.
	Status(id string) (prefetch.JobStatus, bool)
	// Watch returns a channel of the job's statuses that is closed when the
	// job ends (after its final status) or ctx is done, or false for an
	// unknown id.
	Watch(ctx context.Context, id string) (<-chan prefetch.JobStatus, bool)
	// List returns the status of every job the queue remembers.
	List() []prefetch.JobStatus
}

// Usage is what the server needs of the cache.
type Usage interface {
	Usage() cache.Usage
}

// Status is the answer of GET /v1/status.
type Status struct {
	Version string               `json:"version"`
	Cache   cache.Usage          `json:"cache"`
	Jobs    []prefetch.JobStatus `json:"jobs"`
	Peers   []Peer               `json:"peers,omitempty"`
	GPUs    []GPU                `json:"gpus,omitempty"`
	Warm    []WarmServer         `json:"warmServers,omitempty"`
	Loads   []ModelLoad          `json:"modelLoads,omitempty"`
	Mirror  *MirrorStatus        `json:"mirror,omitempty"`
	Volumes []Volume             `json:"volumes,omitempty"`
}

// Volume is a model the CSI plugin has mounted into a pod: its blobs are
// held in the cache until the pod lets it go.
type Volume struct {
	ID        string `json:"id"`
	Namespace string `json:"namespace,omitempty"`
	Pod       string `json:"pod,omitempty"`
	PodUID    string `json:"podUID,omitempty"`
	Name      string `json:"name,omitempty"` // the pod's volume name
	Ref       string `json:"ref"`
	Blobs     int    `json:"blobs"`
	Bytes     int64  `json:"bytes"`
}

// WithVolumes sets where GET /v1/status learns the CSI volumes.
func WithVolumes(volumes func() []Volume) Option {
	return func(s *Server) error { s.volumes = volumes; return nil }
}

// Peer is another agent this one shares chunks with.
type Peer struct {
	Name      string `json:"name"`
	ChunkAddr string `json:"chunkAddr"`
	Zone      string `json:"zone,omitempty"`
}

// FetchRequest is the body of POST /v1/fetch.
type FetchRequest struct {
	Ref string `json:"ref"`
	// Priority is background, normal (the default) or pod.
	Priority string `json:"priority,omitempty"`
}

// errorBody is the body of every error answer.
type errorBody struct {
	Error string `json:"error"`
}

// Server serves the API. It is an http.Handler; the caller owns the
// http.Server and the listener (see Listen).
type Server struct {
	jobs     Jobs
	usage    Usage
	version  string
	ready    func(context.Context) error
	peers    func() []Peer
	gpus     func() []GPU
	warm     func() []WarmServer
	loads    func() []ModelLoad
	mirror   func() MirrorStatus
	volumes  func() []Volume
	adapters Adapters
	log      *slog.Logger
	reqs     *prometheus.CounterVec
	mux      *http.ServeMux
}

// Option configures a Server.
type Option func(*Server) error

// WithVersion sets the version reported by GET /v1/status.
func WithVersion(v string) Option {
	return func(s *Server) error { s.version = v; return nil }
}

// WithReadiness sets the check behind GET /readyz; without one the server is
// ready as soon as it serves.
func WithReadiness(check func(context.Context) error) Option {
	return func(s *Server) error {
		if check == nil {
			return errors.New("api: nil readiness check")
		}
		s.ready = check
		return nil
	}
}

// WithPeers sets where GET /v1/status learns the live peers.
func WithPeers(peers func() []Peer) Option {
	return func(s *Server) error { s.peers = peers; return nil }
}

// WithLogger sets the logger; the server is silent by default.
func WithLogger(l *slog.Logger) Option {
	return func(s *Server) error {
		if l == nil {
			return errors.New("api: nil logger")
		}
		s.log = l
		return nil
	}
}

// WithRegisterer registers weightd_api_requests_total on r.
func WithRegisterer(r prometheus.Registerer) Option {
	return func(s *Server) error {
		s.reqs = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weightd_api_requests_total",
			Help: "Requests to the agent's local API by route and status code.",
		}, []string{"route", "code"})
		return r.Register(s.reqs)
	}
}

// NewServer returns the API server over the prefetch jobs and the cache.
func NewServer(jobs Jobs, usage Usage, opts ...Option) (*Server, error) {
	s := &Server{
		jobs:    jobs,
		usage:   usage,
		version: "dev",
		log:     slog.New(slog.DiscardHandler),
		mux:     http.NewServeMux(),
	}
	for _, o := range opts {
		if err := o(s); err != nil {
			return nil, err
		}
	}
	s.mux.HandleFunc("POST /v1/fetch", s.submit)
	s.mux.HandleFunc("GET /v1/fetch", s.list)
	s.mux.HandleFunc("GET /v1/fetch/{id}", s.job)
	s.mux.HandleFunc("GET /v1/fetch/{id}/watch", s.watch)
	s.mux.HandleFunc("DELETE /v1/fetch/{id}", s.cancel)
	s.mux.HandleFunc("GET /v1/status", s.status)
	s.mux.HandleFunc("POST /v1/adapters", s.ensureAdapter)
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
	s.mux.HandleFunc("GET /readyz", s.readyz)
	return s, nil
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rw := &response{ResponseWriter: w, r: r, code: http.StatusOK}
	s.mux.ServeHTTP(rw, r)
	if s.reqs != nil {
		route := r.Pattern
		if route == "" {
			route = "other"
		}
		s.reqs.WithLabelValues(route, strconv.Itoa(rw.code)).Inc()
	}
}

func (s *Server) submit(w http.ResponseWriter, r *http.Request) {
	var req FetchRequest
	if !decodeBody(w, r, &req) {
		return
	}
	if req.Ref == "" {
		writeError(w, http.StatusBadRequest, "missing field ref")
		return
	}
	p := prefetch.PriorityNormal
	if req.Priority != "" {
		var err error
		if p, err = prefetch.ParsePriority(req.Priority); err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	st, err := s.jobs.Submit(req.Ref, p)
	switch {
	case errors.Is(err, ref.ErrInvalid):
		writeError(w, http.StatusBadRequest, err.Error())
		return
	case err != nil:
		s.log.Warn("submitting fetch", "err", err)
		writeError(w, http.StatusServiceUnavailable, err.Error())
		return
	}
	s.log.Debug("fetch submitted", "ref", st.Ref, "job", st.ID)
	writeJSON(w, http.StatusAccepted, st)
}

func (s *Server) list(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, nonNil(s.jobs.List()))
}

func (s *Server) job(w http.ResponseWriter, r *http.Request) {
	st, ok := s.jobs.Status(r.PathValue("id"))
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no job %q", r.PathValue("id")))
		return
	}
	writeJSON(w, http.StatusOK, st)
}

// cancel cancels a job and answers with its status of the moment: a queued
// job is failed at once, a running one soon.
func (s *Server) cancel(w http.ResponseWriter, r *http.Request) {
	st, ok := s.jobs.Cancel(r.PathValue("id"))
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no job %q", r.PathValue("id")))
		return
	}
	s.log.Info("fetch cancelled", "ref", st.Ref, "job", st.ID)
	writeJSON(w, http.StatusOK, st)
}

// watch streams the job's statuses as NDJSON until the job ends, the client
// goes away or the server shuts down (the request's context ends).
func (s *Server) watch(w http.ResponseWriter, r *http.Request) {
	ch, ok := s.jobs.Watch(r.Context(), r.PathValue("id"))
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no job %q", r.PathValue("id")))
		return
	}
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	enc := json.NewEncoder(w)
	for st := range ch {
		if err := enc.Encode(st); err != nil {
			s.log.Debug("watch ended by the client", "job", st.ID, "err", err)
			return
		}
		if err := rc.Flush(); err != nil {
			s.log.Debug("watch ended by the client", "job", st.ID, "err", err)
			return
		}
	}
}

func (s *Server) status(w http.ResponseWriter, _ *http.Request) {
	st := Status{
		Version: s.version,
		Cache:   s.usage.Usage(),
		Jobs:    nonNil(s.jobs.List()),
	}
	if s.peers != nil {
		st.Peers = s.peers()
	}
	if s.gpus != nil {
		st.GPUs = s.gpus()
	}
	if s.warm != nil {
		st.Warm = s.warm()
	}
	if s.loads != nil {
		st.Loads = s.loads()
	}
	if s.mirror != nil {
		m := s.mirror()
		st.Mirror = &m
	}
	if s.volumes != nil {
		st.Volumes = s.volumes()
	}
	writeJSON(w, http.StatusOK, st)
}

func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	if s.ready != nil {
		if err := s.ready(r.Context()); err != nil {
			writeError(w, http.StatusServiceUnavailable, err.Error())
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

// decodeBody decodes one JSON object with no unknown fields from the
// request body into v, or answers 400 (413 when too large) and returns false.
func decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, MaxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes", MaxBodyBytes))
			return false
		}
		writeError(w, http.StatusBadRequest, "decoding request body: "+err.Error())
		return false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		writeError(w, http.StatusBadRequest, "decoding request body: data after the JSON object")
		return false
	}
	return true
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	// The status line is out: an encoding error can only be the client gone.
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, errorBody{Error: msg})
}

// response remembers the status code for the request counter, and turns the
// mux's own plain-text errors (404 for an unknown route, 405 for a wrong
// method) into JSON errors like every other. Unwrap keeps
// http.ResponseController (Flush) working through it.
type response struct {
	http.ResponseWriter
	r        *http.Request
	code     int
	wrote    bool
	replaced bool // the body was replaced by a JSON error; drop what follows
}

func (w *response) WriteHeader(code int) {
	if w.wrote {
		w.ResponseWriter.WriteHeader(code)
		return
	}
	w.code, w.wrote = code, true
	if code >= 400 && strings.HasPrefix(w.Header().Get("Content-Type"), "text/plain") {
		w.replaced = true
		writeError(w.ResponseWriter, code, fmt.Sprintf("%s %s: %s", w.r.Method, w.r.URL.Path, strings.ToLower(http.StatusText(code))))
		return
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *response) Write(b []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	if w.replaced {
		return len(b), nil
	}
	return w.ResponseWriter.Write(b)
}

func (w *response) Unwrap() http.ResponseWriter { return w.ResponseWriter }
