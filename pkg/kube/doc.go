// Package kube connects a weightd agent to Kubernetes: it takes requests from
// the pods bound to its node and answers on them, it serves the node's warm
// servers and the pods that ask them for LoRA adapters, and it publishes the
// node's cache state on its Node object for the scheduler and for people.
//
//   - PodIntake watches only the pods whose spec.nodeName is this node (so its
//     memory is bounded by this node's pods), parses their weightd.io/
//     annotations with podrequest, submits every reference to the prefetch
//     queue at once at PriorityPod (the agent races the kubelet), and answers
//     on each pod with the weightd.io/status annotation ("queued",
//     "fetching 43%", "ready", "failed: …"), debounced per pod, and with
//     Events (Prefetching, Prefetched, PrefetchFailed, InvalidAnnotation)
//     through client-go's event recorder and its spam filter.
//   - NodePublisher labels the node models.weightd.io/<key>=ready for each
//     reference whose job ended ready and whose blobs are still in the cache,
//     and writes the size-bounded summary annotation (nodestate), with
//     server-side apply under the field manager "weightd", at most once per
//     interval however fast chunks arrive. At start it rebuilds its state from
//     the node's summary annotation, resubmitting those references at
//     PriorityBackground (cache hits download nothing). With WithWarmBases
//     it also labels the node warm.weightd.io/<key>=ready for each base a
//     healthy warm server of the node keeps resident.
//   - WarmPods is the warm pool's side: it finds the node's warm servers
//     (pods labelled weightd.io/warm-server=true in the namespaces the
//     operator allows, described by their annotations) and gives them to
//     the pool, answers the pods that ask for a LoRA adapter
//     (weightd.io/lora-base and lora-adapter), from servers of their own
//     namespace or shared ones, with
//     weightd.io/lora-endpoint and lora-model, or lora-error, and Events
//     (AdapterReady, AdapterFailed, InvalidAnnotation), keeping the adapter
//     in use while the pod lives, and writes on each healthy warm server's
//     pod the adapters loaded in it (weightd.io/loaded-adapters).
//
// In an agent they share one Shared (NewShared), with NodeEvents,
// PodVolumes and the policy controller: one watch of the node's pods, one
// of its Node, one event broadcaster. A component given none watches and
// records on its own.
//
// Each has a Run(ctx) error that returns only when ctx ends: an API server
// that is down or restarting never stops the agent; informers reconnect, and
// writes are retried with backoff. None holds anything the local API or the
// prefetch queue depends on.
package kube
