// Package source turns references into what the fetch queue downloads: a
// Source resolves a ref.Ref to a Resolution (a model's files, packed layers
// to unpack, or a container image) with a content.RangeOpener per blob that
// reads it from the origin at any offset. Sources dispatches by kind to the
// four sources, one package each:
//
//   - pkg/source/oci: OCI registries (images and ModelPack models)
//   - pkg/source/hf: the Hugging Face hub
//   - pkg/source/http: plain HTTP(S) files and model manifests
//   - pkg/source/s3: AWS S3 and S3-compatible stores
//
// pkg/source/dialguard is the dialer that keeps pod-named references off
// the node's own and metadata addresses. This package also holds what those
// sources share: ModelName (the name a reference is laid out under, from the
// reference alone), AgentCredentials and Requester (whose requests may carry
// the agent's credentials), and StatusError.
//
// Sources stay small: they open ranges and classify errors (content.Permanent
// for what retrying cannot fix). Retries, resume, stall detection and
// verification live in the cache (pkg/cache), queueing and unpacking in
// pkg/prefetch.
package source
