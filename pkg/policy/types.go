package policy

import (
	"crypto/sha256"
	_ "embed" // the CRD
	"encoding/hex"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// CRD is the CustomResourceDefinition of PrefetchPolicy, as YAML.
//
//go:embed crd.yaml
var CRD []byte

// Names of the resource.
const (
	Group      = "weightd.io"
	Version    = "v1alpha1"
	Kind       = "PrefetchPolicy"
	Resource   = "prefetchpolicies"
	APIVersion = Group + "/" + Version
)

// GVR is the resource of PrefetchPolicy, for the dynamic client.
var GVR = schema.GroupVersionResource{Group: Group, Version: Version, Resource: Resource}

// Limits of a policy, also enforced by the CRD's schema.
const (
	MaxModels    = 64
	MaxImages    = 64
	MaxReasonLen = 512 // failure reasons are cut to this (the schema allows 1024)
	MaxRefLen    = 4096
)

// PrefetchPolicy is the custom resource.
type PrefetchPolicy struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   Spec   `json:"spec"`
	Status Status `json:"status,omitempty"`
}

// Spec is what a policy asks of the nodes it selects.
type Spec struct {
	// NodeSelector selects the nodes by their labels; {} selects every
	// node, a missing selector none.
	NodeSelector *metav1.LabelSelector `json:"nodeSelector,omitempty"`
	// Models are model references (oci://, hf://, https://).
	Models []string `json:"models,omitempty"`
	// Images are container images as pod specs name them.
	Images []string `json:"images,omitempty"`
	// Pin keeps the content's blobs from eviction; nil means true.
	Pin *bool `json:"pin,omitempty"`
}

// Pinned reports whether the policy pins its content (the default).
func (s Spec) Pinned() bool { return s.Pin == nil || *s.Pin }

// Status is the policy's status: one entry per node, and counts over them.
type Status struct {
	// NodeCount, ReadyNodes and FailedNodes count the entries of Nodes:
	// all, those ready at the policy's generation, those with failures.
	NodeCount   int32 `json:"nodeCount,omitempty"`
	ReadyNodes  int32 `json:"readyNodes,omitempty"`
	FailedNodes int32 `json:"failedNodes,omitempty"`
	// Nodes has one entry per node that the policy selects, each written
	// by that node's agent only.
	Nodes []NodeStatus `json:"nodes,omitempty"`
}

// NodeState sums up a node's entry.
type NodeState string

// Node states.
const (
	// NodeReady: everything the policy names is held.
	NodeReady NodeState = "Ready"
	// NodeFetching: nothing failed, something is queued or downloading.
	NodeFetching NodeState = "Fetching"
	// NodeFailed: something failed (see Failed).
	NodeFailed NodeState = "Failed"
)

// NodeStatus is one node's entry in a policy's status.
type NodeStatus struct {
	Name  string    `json:"name"`
	State NodeState `json:"state"`
	// Ready, Fetching and Failed list the policy's references (canonical,
	// queries redacted) by where they are on the node.
	Ready    []string  `json:"ready,omitempty"`
	Fetching []string  `json:"fetching,omitempty"`
	Failed   []Failure `json:"failed,omitempty"`
	// Bytes of the policy's content held on the node.
	Bytes int64 `json:"bytes"`
	// ObservedGeneration is the policy generation the entry describes.
	ObservedGeneration int64       `json:"observedGeneration"`
	Updated            metav1.Time `json:"updated"`
}

// Failure is a reference that failed on a node, and why.
type Failure struct {
	Ref    string `json:"ref"`
	Reason string `json:"reason"`
}

// Counts computes the status counts over the entries, for a policy at
// generation gen: an entry counts as ready only if it describes gen.
func Counts(nodes []NodeStatus, gen int64) (count, ready, failed int32) {
	for _, n := range nodes {
		count++
		switch {
		case n.State == NodeFailed:
			failed++
		case n.State == NodeReady && n.ObservedGeneration == gen:
			ready++
		}
	}
	return count, ready, failed
}

// Entry returns the entry of node, if any.
func (s Status) Entry(node string) (NodeStatus, bool) {
	for _, n := range s.Nodes {
		if n.Name == node {
			return n, true
		}
	}
	return NodeStatus{}, false
}

// FromUnstructured converts an object read with the dynamic client.
func FromUnstructured(u *unstructured.Unstructured) (*PrefetchPolicy, error) {
	var p PrefetchPolicy
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.UnstructuredContent(), &p); err != nil {
		return nil, fmt.Errorf("converting PrefetchPolicy %q: %w", u.GetName(), err)
	}
	return &p, nil
}

// ToUnstructured converts a policy for the dynamic client; it sets the
// apiVersion and kind.
func ToUnstructured(p *PrefetchPolicy) (*unstructured.Unstructured, error) {
	q := *p
	q.APIVersion, q.Kind = APIVersion, Kind
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&q)
	if err != nil {
		return nil, fmt.Errorf("converting PrefetchPolicy %q: %w", p.Name, err)
	}
	return &unstructured.Unstructured{Object: m}, nil
}

// maxFieldManager is the longest field manager name the API server accepts.
const maxFieldManager = 128

// FieldManager is the server-side apply field manager under which node's
// agent writes its entry: "weightd-node-<node>", or, for a node name too long
// for a field manager (128 bytes), its first bytes and a hash.
func FieldManager(node string) string {
	m := "weightd-node-" + node
	if len(m) <= maxFieldManager {
		return m
	}
	sum := sha256.Sum256([]byte(node))
	h := hex.EncodeToString(sum[:8])
	return m[:maxFieldManager-len(h)-1] + "-" + h
}

// SummaryFieldManager is the field manager of the status counts, shared by
// every agent so that correcting them never conflicts.
const SummaryFieldManager = "weightd-policy-summary"

// PinOwner is the cache pin owner of a policy's blobs.
func PinOwner(policy string) string { return pinPrefix + policy }

const pinPrefix = "policy/"
