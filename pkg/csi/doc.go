// Package csi is weightd's CSI node plugin: it lets a pod mount a model as a
// volume (driver models.weightd.io) without knowing the node's cache paths,
// and registers itself with the kubelet through the plugin-registration API,
// so no node-driver-registrar sidecar is needed.
//
// NodePublishVolume queues the model's fetch through the agent's prefetch
// queue at the pod's priority on behalf of the pod's namespace (so
// --agent-credentials applies as for any other pod request). Until the model
// is ready it answers codes.Unavailable with the fetch's progress, which the
// kubelet shows in the pod's events and retries. Once ready it builds a
// per-volume directory of hard links to the cache's blobs and bind-mounts it
// read-only at the target:
//
//	<target>/<path>                                         the model's files under their own names
//	<target>/model.json                                     name, revision, ref and each file's path, digest and size
//	<target>/hub/models--org--name/snapshots/<rev>/<path>   the Hugging Face hub cache layout
//	<target>/hub/models--org--name/refs/<branch>            holding <rev>, when the reference named a branch or tag
//
// so a Hugging Face loader finds the model by name offline with
// HF_HUB_CACHE=<target>/hub and HF_HUB_OFFLINE=1.
//
// Hard links, not a bind of the cache's snapshot: the snapshot's entries are
// symlinks relative into blobs/, which would dangle in a mount of the
// snapshot alone, and binding the whole cache would show the pod every other
// model. A hard link names the blob's own inode, so no byte is copied, the
// pod can open nothing outside its model, and the per-volume directory lives
// under the cache's root so that links never cross a filesystem.
//
// Every file is checked against the cache's index when published (a regular
// file of the verified size), so a blob removed or rewritten by hand fails the
// publish instead of giving the pod a broken tree, and is discarded from the
// cache so that the kubelet's next try fetches it again.
//
// A published volume holds its blobs against eviction until it is
// unpublished. A record per volume under the agent's state directory names
// its target and blobs and is what survives a restart: Reconcile, run before
// the fetch queue starts, holds the blobs of volumes still mounted again and
// drops the records of volumes whose target is no longer a mount. A model
// larger than the cache's budget is refused by the cache, which evicts
// nothing for it.
package csi
