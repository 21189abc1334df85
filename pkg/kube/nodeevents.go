package kube

import (
	"context"
	"errors"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// Event reasons on the agent's Node.
const (
	// ReasonMirrorNotConfigured (Warning): the node's containerd does not
	// read the hosts.toml files of the agent's registry mirror, so the
	// kubelet's pulls bypass the mirror (they still work).
	ReasonMirrorNotConfigured = "MirrorNotConfigured"
	// ReasonMirrorConfigured (Normal): it reads them again.
	ReasonMirrorConfigured = "MirrorConfigured"
)

// MaxNodeEventLen bounds the message of an Event on the node, in bytes:
// room for what is wrong and how to fix it.
const MaxNodeEventLen = 1024

// nodeEventQueue is how many Events NodeEvents holds until Run records
// them; more are dropped.
const nodeEventQueue = 16

// NodeEvents records Events on the agent's Node object, where `kubectl
// describe node` shows them: what is wrong with the node itself rather than
// with a pod. The Events name the node as the kubelet's do (its name as its
// UID), from the source component weightd on the node.
type NodeEvents struct {
	client kubernetes.Interface
	node   string
	shared *Shared // nil: its own recorder
	queue  chan nodeEvent
}

type nodeEvent struct{ typ, reason, message string }

// NewNodeEvents returns the Event recorder for node, recording through
// shared (nil: a recorder of its own). It starts nothing: Run records the
// Events.
func NewNodeEvents(client kubernetes.Interface, node string, shared *Shared) (*NodeEvents, error) {
	if client == nil || node == "" {
		return nil, errors.New("kube: node events need a client and a node name")
	}
	return &NodeEvents{client: client, node: node, shared: shared, queue: make(chan nodeEvent, nodeEventQueue)}, nil
}

// Event queues an Event on the node (eventType is corev1.EventTypeNormal or
// EventTypeWarning; the message is cut to MaxNodeEventLen bytes) and returns
// at once: false when the queue is full and the Event was dropped. Events
// made before Run starts are recorded once it does. Safe for concurrent
// use.
func (n *NodeEvents) Event(eventType, reason, message string) bool {
	select {
	case n.queue <- nodeEvent{typ: eventType, reason: reason, message: boundTo(message, MaxNodeEventLen)}:
		return true
	default:
		return false
	}
}

// Run records the queued Events through client-go's event recorder (its
// spam filter and aggregation included) until ctx ends. An API server that
// is down delays them; it never stops Run.
func (n *NodeEvents) Run(ctx context.Context) error {
	recorder, stop := n.shared.recorder(ctx, n.client, n.node)
	defer stop()
	ref := &corev1.ObjectReference{Kind: "Node", Name: n.node, UID: types.UID(n.node)}
	for {
		select {
		case <-ctx.Done():
			return nil
		case e := <-n.queue:
			recorder.Event(ref, e.typ, e.reason, e.message)
		}
	}
}
