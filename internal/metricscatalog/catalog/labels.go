package catalog

// Labels are the label names any weightd metric may carry, each with why its
// values are bounded. A label not here (or in MetricLabels) fails Lint.
var Labels = map[string]string{
	"code":    "an HTTP status code the server answers with: a few dozen at most",
	"commit":  "the build's commit: one value per running binary",
	"kind":    "a fixed set of kinds the code names (source kinds, request kinds, event kinds, write kinds)",
	"outcome": "a fixed set of outcomes the code names (ready, failed, canceled, hit, miss, ok, error, …)",
	"reason":  "a fixed set of reasons the code names",
	"route":   "a route pattern of the server's mux, never the request path",
	"runtime": "an inference server runtime weightd drives (vllm, sglang)",
	"source":  "a fixed set of sources the code names (peer, origin, cache, fetch)",
	"state":   "a fixed set of states the code names",
	"verb":    "a scheduler extender verb (filter, prioritize)",
	"version": "the build's version: one value per running binary",
	"gpu":     "a GPU index on this node: at most the node's GPUs (8, 16)",
}

// MetricLabel names a label on one metric.
type MetricLabel struct {
	Metric, Label string
}

// MetricLabels are labels allowed on one metric only, each with why its
// values are bounded there: they are names (Unbounded) that are unbounded in
// general.
var MetricLabels = map[MetricLabel]string{
	{"weightd_prefetch_ready_seconds", "model"}: "bounded by the prefetch queue's label limiter: the first models seen " +
		"(50 by default, prefetch.WithModelLabels) keep their name, later ones are counted as \"other\"",
	{"weightd_warmpool_base_gpu_memory_bytes", "base"}: "the base models of the warm servers on this node: a handful, " +
		"each holding GPU memory",
}

// Unbounded are label names whose values are unbounded in general (one per
// blob, pod, node, model, file…): never a label unless MetricLabels allows
// it on one metric with a reason.
var Unbounded = []string{"base", "blob", "digest", "file", "model", "name", "namespace", "node", "path", "pod", "ref", "uid", "url"}
