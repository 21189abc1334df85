// Package prefetch brings models and images onto the node before anything
// asks for them: it resolves references through sources to blobs named by
// digest, and runs the fetch queue that downloads those blobs into the
// cache and materialises models as directories (or hands images to an
// Importer).
//
// # References
//
// A reference (package ref, which holds the grammar) names a model, an
// image or a single file where it can be fetched from: oci://, hf://,
// https://, http:// or s3://. ModelName is the name a reference's model is
// laid out under in the cache.
//
// # Sources
//
// A Source turns a ref.Ref into a Resolution: the model's files (path,
// digest, size), packed layers to unpack (ModelPack tar, gzip and zstd
// layers), or an image for the container runtime, and for each blob a
// content.RangeOpener that reads it from the origin starting at any offset. HTTPSource,
// OCISource (go-containerregistry: Docker config and pull-secret
// credentials, token auth, platform selection from indexes) and HFSource
// (the hub's revision, tree and resolve APIs) and S3Source (the AWS SDK,
// for AWS S3 and S3-compatible stores) are the four kinds; Sources
// dispatches by kind. Sources stay small: they open ranges and classify
// errors (content.Permanent for what retrying cannot fix). Retries, resume,
// stall detection and verification live in the cache.
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
