// Package prefetch brings models and images onto the node before anything
// asks for them: it runs the fetch queue that resolves references through a
// source.Source, downloads the blobs they name by digest into the cache,
// unpacks packed layers and materialises models as directories (or hands
// images to an Importer).
//
// # References and sources
//
// A reference (package ref, which holds the grammar) names a model, an
// image or a single file where it can be fetched from: oci://, hf://,
// https://, http:// or s3://. Resolving one is a source's work, and the
// sources live in pkg/source: the Source interface, Resolution and the
// Sources dispatcher there, one package per kind below it (pkg/source/oci,
// pkg/source/hf, pkg/source/http, pkg/source/s3). source.ModelName is the
// name a reference's model is laid out under in the cache. Unpack extracts
// a source's packed layers; CheckWithoutOrigin checks what another node
// says a reference resolved to while its origin cannot be reached.
//
// # The queue
//
// A Queue takes references (Submit) at a priority (a pod waiting beats a
// person, who beats a background policy), deduplicates concurrent requests
// for the same reference, runs a bounded number of jobs at a time, each
// fetching a bounded number of blobs at a time (largest first), retries
// resolving and importing with jittered backoff, unpacks packed layers, then
// materialises the model or imports the image. Jobs can be cancelled and
// stream their progress to watchers. A FileOrder (WithFileOrder), such as
// the model-load tracer's, puts the files a model's server read first at
// the front of the fetch.
//
// # Observability
//
// The queue's metrics (WithRegisterer) count jobs by kind and outcome, time
// them, and time submission to ready per model in
// weightd_prefetch_ready_seconds{model}: the model label names the first 50
// models seen (WithModelLabels) and calls the rest "other", through a
// LabelLimiter that other per-model metrics can use too. With
// WithTracerProvider each job is an OpenTelemetry "prefetch" span with
// "resolve", "fetch" (per blob), "unpack", "commit" and "import" children;
// without it nothing is traced.
package prefetch
