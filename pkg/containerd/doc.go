// Package containerd puts an image whose blobs are already in weightd's cache
// into the node's containerd, so that the kubelet (through containerd's CRI
// plugin) finds it present and starts containers without pulling it.
//
// An import writes the blobs containerd lacks into its content store, with
// the labels containerd itself sets on a pull (the gc.ref.content references
// from index to manifest to config and layers, the distribution source) so
// its garbage collector keeps them; unpacks the image for the snapshotter;
// and only then creates or updates the image record. Until that last step
// the content is held by a containerd lease, so a failed import leaves no
// image record pointing at missing content or at an image not unpacked, and
// whatever it wrote is collected once the lease is gone.
//
// Where the cache and containerd's content store are on one filesystem (in
// one mount), a blob is not written at all: its cache file, hashed again,
// is hard-linked into the content store and containerd's content sharing
// registers it (link.go, Config.ContentRoot). Wherever a link cannot be
// made, blobs are written over gRPC.
//
// Import takes an image whose blobs are all in the cache. Begin starts an
// import while they are still downloading: each blob is written into
// containerd as soon as it is handed over, and a background unpacker
// applies the layers, base first, as soon as each is written, so that when
// the last blob lands little is left but to create the records.
package containerd
