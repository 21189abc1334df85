package kube

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
)

// Shared is what one agent's Kubernetes components share, so that the
// node's pods and its Node object are each listed and watched once, and
// Events go through one broadcaster: give it to the pod intake
// (WithIntakeShared), WarmPods (WithWarmShared), the node publisher
// (WithPublisherShared), NodeEvents, PodVolumes and the policy controller
// (its Config's Recorder and Nodes). A component given none watches and
// records on its own.
type Shared struct {
	// Pods lists and watches node's pods (slimmed as the intake and
	// WarmPods need them); Nodes, its Node object (labels and annotations).
	Pods, Nodes informers.SharedInformerFactory
	// Recorder records Events from weightd on node.
	Recorder    record.EventRecorder
	broadcaster record.EventBroadcaster
}

// NewShared returns what node's components share. It starts the event
// broadcaster, which Close stops; the informers start with the first
// component that runs.
func NewShared(client kubernetes.Interface, node string) *Shared {
	b := record.NewBroadcaster()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	return &Shared{
		Pods: nodePods(client, node), Nodes: nodeObject(client, node),
		Recorder:    b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: FieldManager, Host: node}),
		broadcaster: b,
	}
}

// Close stops the informers and sends the Events recorded so far. Call it
// once the components that share s have returned.
func (s *Shared) Close() {
	s.Pods.Shutdown()
	s.Nodes.Shutdown()
	s.broadcaster.Shutdown()
}

// recorder is s's Recorder, or, for a component given no Shared, one of its
// own that stop flushes and ends.
func (s *Shared) recorder(ctx context.Context, client kubernetes.Interface, node string) (recorder record.EventRecorder, stop func()) {
	if s != nil {
		return s.Recorder, func() {}
	}
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	return broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: FieldManager, Host: node}), broadcaster.Shutdown
}

// pods is s's Pods, or a factory of the component's own that shutdown
// stops.
func (s *Shared) pods(client kubernetes.Interface, node string) (factory informers.SharedInformerFactory, shutdown func()) {
	if s != nil {
		return s.Pods, func() {}
	}
	f := nodePods(client, node)
	return f, f.Shutdown
}

// nodes is s's Nodes, or a factory of the component's own that shutdown
// stops.
func (s *Shared) nodes(client kubernetes.Interface, node string) (factory informers.SharedInformerFactory, shutdown func()) {
	if s != nil {
		return s.Nodes, func() {}
	}
	f := nodeObject(client, node)
	return f, f.Shutdown
}

// nodePods is an informer factory that lists and watches only the pods
// bound to node (a field selector on spec.nodeName), each put through
// slimPod.
func nodePods(client kubernetes.Interface, node string) informers.SharedInformerFactory {
	return informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		}),
		informers.WithTransform(slimPod),
	)
}

// nodeObject is an informer factory of node's Node object alone, put
// through slimNode.
func nodeObject(client kubernetes.Interface, node string) informers.SharedInformerFactory {
	return informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", node).String()
		}),
		informers.WithTransform(slimNode),
	)
}
