// Package mirror serves the OCI distribution pull API on the node as a
// registry mirror, so the kubelet's own image pulls (containerd configured
// with hosts.toml, see ConfigureHosts) are answered from the weightd cache and
// the peer swarm, with the upstream registry as the last resort.
//
// Manifests by tag are resolved upstream (tags move) and remembered, so that
// a pull of public content still succeeds from the cache while the upstream
// is down. Requests go upstream with the client's own credentials (see
// auth.go): the cache is shared, so private content goes only to clients the
// registry lets have it; a small blob's confirmation is the blob itself
// (confirmBlob). Manifests
// by digest and blobs are served from the cache; a missing blob is fetched
// into the cache and streamed to the client as its chunks arrive, never
// buffered whole. Nothing is ever served as a complete response before the
// whole blob has been verified against its digest.
//
// The mirror is on the critical path of every image pull, and containerd
// gives a mirror 30 s to send response headers before it goes to the
// registry for good: a blob's headers go out at once, its front is fetched
// first (Prioritizer), a GET of an image manifest starts the fetch of all
// its layers, and a blob whose fetch just failed is answered 503 at once so
// the client's retry moves on to the registry.
package mirror
