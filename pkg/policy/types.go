package policy

import (
	"crypto/sha256"
	_ "embed" // the CRD
	"encoding/hex"
	"fmt"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// CRD holds the CustomResourceDefinitions of PrefetchPolicy and
// PrefetchPolicyNode, as YAML documents.
//
//go:embed crd.yaml
var CRD []byte

// Names of the resources.
const (
	Group        = "weightd.io"
	Version      = "v1alpha1"
	Kind         = "PrefetchPolicy"
	Resource     = "prefetchpolicies"
	NodeKind     = "PrefetchPolicyNode"
	NodeResource = "prefetchpolicynodes"
	APIVersion   = Group + "/" + Version
)

// GVR is the resource of PrefetchPolicy, for the dynamic client.
var GVR = schema.GroupVersionResource{Group: Group, Version: Version, Resource: Resource}

// NodeGVR is the resource of PrefetchPolicyNode.
var NodeGVR = schema.GroupVersionResource{Group: Group, Version: Version, Resource: NodeResource}

// Labels of a PrefetchPolicyNode: its policy and its node (LabelValue of
// their names).
const (
	PolicyLabel = "weightd.io/policy"
	NodeLabel   = "weightd.io/node"
)

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

// Status is the policy's status: counts over its PrefetchPolicyNodes,
// written by the elected Summarizer.
type Status struct {
	// NodeCount, ReadyNodes and FailedNodes count the policy's
	// PrefetchPolicyNodes: all, those ready at the policy's generation,
	// those with failures.
	NodeCount   int32 `json:"nodeCount,omitempty"`
	ReadyNodes  int32 `json:"readyNodes,omitempty"`
	FailedNodes int32 `json:"failedNodes,omitempty"`
}

// PrefetchPolicyNode is one node's progress on one policy, written by that
// node's agent only. It is named NodeObjectName(policy, node), labelled
// with both, and owned by the policy (deleted with it).
type PrefetchPolicyNode struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Status NodeStatus `json:"status"`
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

// NodeStatus is one node's progress on a policy: the status of its
// PrefetchPolicyNode.
type NodeStatus struct {
	// Name is the node's.
	Name  string    `json:"name"`
	State NodeState `json:"state"`
	// Ready, Fetching and Failed list the policy's references (canonical,
	// queries redacted) by where they are on the node.
	Ready    []string  `json:"ready,omitempty"`
	Fetching []string  `json:"fetching,omitempty"`
	Failed   []Failure `json:"failed,omitempty"`
	// ReadyCount and FailedCount are the lengths of Ready and Failed, for
	// the printer columns (which cannot count a list).
	ReadyCount  int32 `json:"readyCount"`
	FailedCount int32 `json:"failedCount"`
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

// Counts computes the status counts over the nodes' progress, for a policy
// at generation gen: a node counts as ready only if its status describes
// gen.
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

// NodeFromUnstructured converts a PrefetchPolicyNode read with the dynamic
// client.
func NodeFromUnstructured(u *unstructured.Unstructured) (*PrefetchPolicyNode, error) {
	var n PrefetchPolicyNode
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.UnstructuredContent(), &n); err != nil {
		return nil, fmt.Errorf("converting PrefetchPolicyNode %q: %w", u.GetName(), err)
	}
	return &n, nil
}

// Longest names the API server accepts: an object's (a DNS subdomain) and a
// label value.
const (
	maxObjectName = 253
	maxLabelValue = 63
)

// NodeObjectName is the name of node's PrefetchPolicyNode of policy:
// "<policy>.<node>". When the policy's name has a dot, "<policy>.<node>"
// could also be another pair's (policy "a.b" on node "c", policy "a" on node
// "b.c"), so a hash of both names follows, after a dash; when the name would
// be too long (253 bytes), its first bytes and the hash.
func NodeObjectName(policy, node string) string {
	full := policy + "." + node
	if len(full) <= maxObjectName && !strings.Contains(policy, ".") {
		return full
	}
	return hashCut(full, maxObjectName-hashLen-1, policy+"\x00"+node)
}

// LabelValue is name as a label value: itself, or, when too long for one
// (63 bytes), its first bytes, a dash and a hash. Policy and node names are
// DNS subdomains, whose characters label values allow.
func LabelValue(name string) string {
	if len(name) <= maxLabelValue {
		return name
	}
	return hashCut(name, maxLabelValue-hashLen-1, name)
}

// hashLen is the length of the hash that hashCut appends.
const hashLen = 16

// hashCut returns s cut to n bytes, without a trailing dot or dash (names
// and label values end in an alphanumeric), then a dash and a hash of key.
func hashCut(s string, n int, key string) string {
	sum := sha256.Sum256([]byte(key))
	return strings.TrimRight(s[:min(len(s), n)], ".-") + "-" + hex.EncodeToString(sum[:hashLen/2])
}

// maxFieldManager is the longest field manager name the API server accepts.
const maxFieldManager = 128

// FieldManager is the server-side apply field manager under which node's
// agent writes its PrefetchPolicyNodes: "weightd-node-<node>", or, for a node name too long
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

// SummaryFieldManager is the field manager of the policies' status counts,
// shared by every agent so that a new leader takes them over without
// conflict.
const SummaryFieldManager = "weightd-policy-summary"

// PinOwner is the cache pin owner of a policy's blobs.
func PinOwner(policy string) string { return pinPrefix + policy }

const pinPrefix = "policy/"
