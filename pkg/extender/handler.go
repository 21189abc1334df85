package extender

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/weightd/weightd/pkg/podrequest"
)

// DefaultMaxBodyBytes bounds a request body unless WithMaxBodyBytes says
// otherwise. A prioritize call in nodenames mode for 5,000 nodes is about
// 100 KiB; in nodes mode every candidate Node object travels in full (tens of
// KiB each with its image list), which is why nodeCacheCapable is the
// recommended configuration for large clusters.
const DefaultMaxBodyBytes = 64 << 20

// Verbs served, as the scheduler configuration names them.
const (
	VerbPrioritize = "prioritize"
	VerbFilter     = "filter"
)

// Handler serves the kube-scheduler extender protocol: POST /prioritize
// (ExtenderArgs → HostPriorityList) and POST /filter (ExtenderArgs →
// ExtenderFilterResult). Build it with NewHandler. It is safe for concurrent
// use.
type Handler struct {
	cache   *Cache
	log     *slog.Logger
	maxBody int64
	mux     *http.ServeMux

	seconds *prometheus.HistogramVec
	invalid prometheus.Counter
}

// Option configures a Handler.
type Option func(*Handler) error

// WithLogger sets where the handler logs pods whose annotations do not parse
// and nodes whose summary it ignored. The default discards.
func WithLogger(l *slog.Logger) Option {
	return func(h *Handler) error {
		if l == nil {
			return errors.New("extender: nil logger")
		}
		h.log = l
		return nil
	}
}

// WithMaxBodyBytes bounds request bodies (DefaultMaxBodyBytes otherwise);
// larger requests are answered 413.
func WithMaxBodyBytes(n int64) Option {
	return func(h *Handler) error {
		if n < 1<<10 {
			return fmt.Errorf("extender: body limit of %d bytes is below 1 KiB", n)
		}
		h.maxBody = n
		return nil
	}
}

// WithRegisterer registers the handler's metrics on r:
// weightd_extender_request_seconds{verb}, weightd_extender_invalid_pods_total
// and weightd_extender_nodes (nodes in the cache).
func WithRegisterer(r prometheus.Registerer) Option {
	return func(h *Handler) error {
		h.seconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "weightd_extender_request_seconds",
			Help:    "Time to answer a scheduler extender call, by verb, from the request's first byte read to its answer written.",
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5},
		}, []string{"verb"})
		h.invalid = prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weightd_extender_invalid_pods_total",
			Help: "Extender calls for pods whose weightd annotations do not parse (scored 0, never filtered out).",
		})
		nodes := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "weightd_extender_nodes",
			Help: "Nodes whose cache state the extender knows.",
		}, func() float64 { return float64(h.cache.Len()) })
		for _, c := range []prometheus.Collector{h.seconds, h.invalid, nodes} {
			if err := r.Register(c); err != nil {
				return fmt.Errorf("extender: registering metrics: %w", err)
			}
		}
		return nil
	}
}

// NewHandler returns a handler answering from cache: in nodenames mode the
// cache is the only source of node state; in nodes mode it saves
// recomputing nodes whose resource version it already holds, and gives the
// sizes of models the request's nodes do not know.
func NewHandler(cache *Cache, opts ...Option) (*Handler, error) {
	if cache == nil {
		return nil, errors.New("extender: nil cache")
	}
	h := &Handler{cache: cache, log: slog.New(slog.DiscardHandler), maxBody: DefaultMaxBodyBytes}
	for _, o := range opts {
		if err := o(h); err != nil {
			return nil, err
		}
	}
	h.mux = http.NewServeMux()
	h.mux.HandleFunc("POST /"+VerbPrioritize, func(w http.ResponseWriter, r *http.Request) { h.serve(VerbPrioritize, w, r) })
	h.mux.HandleFunc("POST /"+VerbFilter, func(w http.ResponseWriter, r *http.Request) { h.serve(VerbFilter, w, r) })
	return h, nil
}

// ServeHTTP serves POST /prioritize and POST /filter.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

func (h *Handler) serve(verb string, w http.ResponseWriter, r *http.Request) {
	if h.seconds != nil {
		defer func(start time.Time) {
			h.seconds.WithLabelValues(verb).Observe(time.Since(start).Seconds())
		}(time.Now())
	}
	args, err := decodeArgs(http.MaxBytesReader(w, r.Body, h.maxBody))
	if err != nil {
		code := http.StatusBadRequest
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			code = http.StatusRequestEntityTooLarge
		}
		h.log.Warn("extender request refused", "verb", verb, "err", err)
		http.Error(w, err.Error(), code)
		return
	}
	var res any
	if verb == VerbPrioritize {
		res, err = h.prioritize(args)
	} else {
		res, err = h.filter(args)
	}
	if err != nil {
		h.log.Warn("extender request refused", "verb", verb, "pod", args.podName(), "err", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if err := json.NewEncoder(w).Encode(res); err != nil {
		h.log.Debug("writing extender answer", "verb", verb, "err", err)
	}
}

// request parses the pod's request. A malformed one is logged, counted and
// reported as ok=false: the caller then neither scores nor filters.
func (h *Handler) request(verb string, a *args) (podrequest.Request, bool) {
	req, err := a.Pod.request()
	if err != nil {
		if h.invalid != nil {
			h.invalid.Inc()
		}
		h.log.Warn("pod's weightd annotations do not parse: scoring 0 and filtering nothing", "verb", verb, "pod", a.podName(), "err", err)
		return podrequest.Request{}, false
	}
	return req, true
}

// prioritize answers a prioritize call: a HostPriorityList with a score for
// every candidate node, or an empty list for a pod asking for nothing (the
// scheduler adds nothing for nodes an extender does not list).
func (h *Handler) prioritize(a *args) (extenderv1.HostPriorityList, error) {
	req, ok := h.request(VerbPrioritize, a)
	if ok && req.Empty() {
		return extenderv1.HostPriorityList{}, nil
	}
	names, nodes, err := a.candidates()
	if err != nil {
		return nil, err
	}
	out := make(extenderv1.HostPriorityList, len(names))
	for i, name := range names {
		out[i].Host = name
	}
	if !ok {
		return out, nil
	}
	h.cache.mu.RLock()
	defer h.cache.mu.RUnlock()
	infos := h.infos(names, nodes)
	p := newPlan(req, h.totals(infos, nodes))
	for i, info := range infos {
		out[i].Score = p.score(info)
	}
	return out, nil
}

// filterResult is ExtenderFilterResult with Nodes kept as raw JSON, so that
// the Node objects of nodes mode are passed back as they came, without a
// decode and re-encode of each.
type filterResult struct {
	Nodes                      json.RawMessage
	NodeNames                  *[]string
	FailedNodes                extenderv1.FailedNodesMap
	FailedAndUnresolvableNodes extenderv1.FailedNodesMap
	Error                      string
}

// rawNodeList is a NodeList whose items are raw JSON.
type rawNodeList struct {
	Kind       string            `json:"kind,omitempty"`
	APIVersion string            `json:"apiVersion,omitempty"`
	Metadata   struct{}          `json:"metadata"`
	Items      []json.RawMessage `json:"items"`
}

// filter answers a filter call. Only pods with require-warm lose nodes: those
// not holding every requested reference ready, named in
// FailedAndUnresolvableNodes (preempting pods would not warm them) with what
// they lack.
func (h *Handler) filter(a *args) (*filterResult, error) {
	res := &filterResult{FailedNodes: extenderv1.FailedNodesMap{}, FailedAndUnresolvableNodes: extenderv1.FailedNodesMap{}}
	req, ok := h.request(VerbFilter, a)
	if !ok || !req.RequireWarm || req.Empty() {
		// Pass every node back as it came.
		if a.NodeNames != nil {
			res.NodeNames = a.NodeNames
			return res, nil
		}
		if _, err := a.items(); err != nil {
			return nil, err
		}
		res.Nodes = a.Nodes
		return res, nil
	}
	names, nodes, err := a.candidates()
	if err != nil {
		return nil, err
	}
	h.cache.mu.RLock()
	infos := h.infos(names, nodes)
	p := newPlan(req, h.totals(infos, nodes))
	passed := make([]int, 0, len(names))
	for i, info := range infos {
		if why := p.missing(info); why != "" {
			res.FailedAndUnresolvableNodes[names[i]] = why
			continue
		}
		passed = append(passed, i)
	}
	h.cache.mu.RUnlock()
	if a.NodeNames != nil {
		kept := make([]string, len(passed))
		for j, i := range passed {
			kept[j] = names[i]
		}
		res.NodeNames = &kept
		return res, nil
	}
	list := rawNodeList{Kind: "NodeList", APIVersion: "v1", Items: make([]json.RawMessage, len(passed))}
	for j, i := range passed {
		list.Items[j] = nodes[i].raw
	}
	if res.Nodes, err = json.Marshal(list); err != nil {
		return nil, err
	}
	return res, nil
}

// infos returns the state of each candidate: from the cache in nodenames
// mode (nil for a node it does not know); in nodes mode from the cache when
// it holds the same resource version, else computed from the object sent.
// The caller holds h.cache.mu for reading.
func (h *Handler) infos(names []string, nodes []wireNode) []*nodeInfo {
	infos := make([]*nodeInfo, len(names))
	for i, name := range names {
		cached := h.cache.nodes[name]
		if nodes == nil {
			infos[i] = cached
			continue
		}
		n := &nodes[i]
		if cached != nil && n.Metadata.ResourceVersion != "" && cached.resourceVersion == n.Metadata.ResourceVersion {
			infos[i] = cached
			continue
		}
		info, err := newNodeInfo(n.fields())
		if err != nil {
			h.log.Debug("node state", "err", err)
		}
		n.fresh = true
		infos[i] = info
	}
	return infos
}

// totals returns the cluster-wide size of a key: what the cache knows, and
// in nodes mode also what the request's own nodes report. The caller holds
// h.cache.mu for reading until it has used the result.
func (h *Handler) totals(infos []*nodeInfo, nodes []wireNode) func(string) int64 {
	return func(key string) int64 {
		t := h.cache.total(key)
		for i := range nodes {
			if nodes[i].fresh {
				t = max(t, infos[i].held[key].total)
			}
		}
		return t
	}
}

// args is ExtenderArgs as the handler decodes it: only the parts of the Pod
// it reads, and Nodes left raw until needed.
type args struct {
	Pod       *wirePod
	Nodes     json.RawMessage
	NodeNames *[]string
}

// wirePod is the part of a Pod the extender reads.
type wirePod struct {
	Metadata struct {
		Name        string            `json:"name"`
		Namespace   string            `json:"namespace"`
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata"`
	Spec struct {
		InitContainers []wireContainer `json:"initContainers"`
		Containers     []wireContainer `json:"containers"`
	} `json:"spec"`
}

type wireContainer struct {
	Image string `json:"image"`
}

// request parses what the pod asks for.
func (p *wirePod) request() (podrequest.Request, error) {
	images := make([]string, 0, len(p.Spec.InitContainers)+len(p.Spec.Containers))
	for _, c := range p.Spec.InitContainers {
		images = append(images, c.Image)
	}
	for _, c := range p.Spec.Containers {
		images = append(images, c.Image)
	}
	return podrequest.Parse(p.Metadata.Annotations, images)
}

// wireNode is the part of a Node the extender reads, with the object's raw
// JSON to pass it back from filter.
type wireNode struct {
	Metadata struct {
		Name            string            `json:"name"`
		ResourceVersion string            `json:"resourceVersion"`
		Labels          map[string]string `json:"labels"`
		Annotations     map[string]string `json:"annotations"`
	} `json:"metadata"`
	Status struct {
		Images []corev1.ContainerImage `json:"images"`
	} `json:"status"`

	raw   json.RawMessage
	fresh bool // its state was computed for this request, not cached
}

func (n *wireNode) fields() nodeFields {
	return nodeFields{
		name:            n.Metadata.Name,
		resourceVersion: n.Metadata.ResourceVersion,
		labels:          n.Metadata.Labels,
		annotations:     n.Metadata.Annotations,
		images:          n.Status.Images,
	}
}

// decodeArgs reads ExtenderArgs. The body is untrusted: its size is bounded
// by the caller's reader; a missing Pod or missing candidates are errors.
func decodeArgs(r io.Reader) (*args, error) {
	var a args
	if err := json.NewDecoder(r).Decode(&a); err != nil {
		return nil, fmt.Errorf("decoding ExtenderArgs: %w", err)
	}
	if a.Pod == nil {
		return nil, errors.New("ExtenderArgs without a Pod")
	}
	if a.NodeNames == nil && isNull(a.Nodes) {
		return nil, errors.New("ExtenderArgs with neither Nodes nor NodeNames")
	}
	return &a, nil
}

func isNull(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

// candidates returns the candidate node names, and in nodes mode the decoded
// nodes (nil in nodenames mode).
func (a *args) candidates() ([]string, []wireNode, error) {
	if a.NodeNames != nil {
		return *a.NodeNames, nil, nil
	}
	items, err := a.items()
	if err != nil {
		return nil, nil, err
	}
	names := make([]string, len(items))
	nodes := make([]wireNode, len(items))
	for i, raw := range items {
		if err := json.Unmarshal(raw, &nodes[i]); err != nil {
			return nil, nil, fmt.Errorf("decoding ExtenderArgs.Nodes item %d: %w", i, err)
		}
		if nodes[i].Metadata.Name == "" {
			return nil, nil, fmt.Errorf("ExtenderArgs.Nodes item %d has no name", i)
		}
		nodes[i].raw = raw
		names[i] = nodes[i].Metadata.Name
	}
	return names, nodes, nil
}

// items returns the raw Node objects of nodes mode, checking that Nodes is
// a NodeList whose items are objects (so that filter can pass them back).
func (a *args) items() ([]json.RawMessage, error) {
	var list struct {
		Items []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(a.Nodes, &list); err != nil {
		return nil, fmt.Errorf("decoding ExtenderArgs.Nodes: %w", err)
	}
	for i, raw := range list.Items {
		if len(raw) == 0 || raw[0] != '{' {
			return nil, fmt.Errorf("ExtenderArgs.Nodes item %d is not an object", i)
		}
	}
	return list.Items, nil
}

func (a *args) podName() string {
	if a == nil || a.Pod == nil {
		return ""
	}
	return a.Pod.Metadata.Namespace + "/" + a.Pod.Metadata.Name
}
