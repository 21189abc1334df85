// Package nodestate is what a weightd agent publishes about its node's cache
// on the Kubernetes Node object, and what readers (the scheduler extender,
// kubectl users, routers) parse back: the label and annotation names, the
// stable short key of a reference, and the size-bounded summary annotation.
// It depends on no Kubernetes library: the agent writes these strings with
// client-go, the extender reads them from its informer.
//
// On a node:
//
//	labels:
//	  models.weightd.io/<key>: ready           one per model or image held complete
//	annotations:
//	  weightd.io/cache: {"v":1,"entries":[…]}   the summary (Summary), at most MaxSummaryBytes
//
// A key is derived from the canonical reference (see Key), so a person can
// compute it (`weightd key REF`) to write a preferred node affinity, and the
// summary maps each key back to its reference.
package nodestate
