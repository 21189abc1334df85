package policy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
)

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// InstallCRD applies the CRDs (server-side, as field manager "weightd")
// and waits until the API server serves both resources, or ctx ends. Tests
// use it; an agent with the right to do so may too.
func InstallCRD(ctx context.Context, dyn dynamic.Interface) error {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(CRD), 4096)
	var names []string
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return fmt.Errorf("reading the CRDs: %w", err)
		}
		u := &unstructured.Unstructured{Object: obj}
		if _, err := dyn.Resource(crdGVR).Apply(ctx, u.GetName(), u, metav1.ApplyOptions{FieldManager: "weightd", Force: true}); err != nil {
			return fmt.Errorf("applying the CRD %s: %w", u.GetName(), err)
		}
		names = append(names, u.GetName())
	}
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for _, name := range names {
		for !served(ctx, dyn, name) {
			select {
			case <-ctx.Done():
				return fmt.Errorf("waiting for the CRD %s to be established: %w", name, ctx.Err())
			case <-t.C:
			}
		}
	}
	return nil
}

// served reports whether the CRD name is established and listed by this
// client's server (whose discovery caches may lag behind).
func served(ctx context.Context, dyn dynamic.Interface, name string) bool {
	got, err := dyn.Resource(crdGVR).Get(ctx, name, metav1.GetOptions{})
	if err != nil || !established(got) {
		return false
	}
	plural, _, _ := unstructured.NestedString(got.Object, "spec", "names", "plural")
	_, err = dyn.Resource(schema.GroupVersionResource{Group: Group, Version: Version, Resource: plural}).List(ctx, metav1.ListOptions{Limit: 1})
	return err == nil
}

func established(u *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if ok && m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

// DeleteNodeStatus deletes node's PrefetchPolicyNode of the policy named
// name, if there is one. The agent deletes its own when its node stops
// matching; the elected Summarizer those of Nodes deleted from the cluster.
func DeleteNodeStatus(ctx context.Context, dyn dynamic.Interface, name, node string) error {
	err := dyn.Resource(NodeGVR).Delete(ctx, NodeObjectName(name, node), metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("deleting the status of node %s on policy %s: %w", node, name, err)
	}
	return nil
}
