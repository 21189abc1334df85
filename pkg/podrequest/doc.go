// Package podrequest reads what a pod asks of weightd through its
// annotations: the models to have on its node before it starts, whether to
// prefetch its own container images, whether it needs a warm node. The
// agent's pod intake and the scheduler extender parse the same annotations
// with it. Annotations are untrusted input: Parse bounds them and names the
// reference at fault. It depends on no Kubernetes library.
//
//	metadata:
//	  annotations:
//	    weightd.io/models: "hf://org/name@rev, oci://registry/repo:tag"
//	    weightd.io/prefetch-images: "true"
//	    weightd.io/require-warm: "true"
//
// The agent answers on the pod with the weightd.io/status annotation
// ("fetching 43%", "ready", "failed: …").
package podrequest
