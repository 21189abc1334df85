package policy

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
)

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// InstallCRD applies CRD (server-side, as field manager "weightd") and waits
// until the API server serves the resource, or ctx ends. Tests use it; an
// agent with the right to do so may too.
func InstallCRD(ctx context.Context, dyn dynamic.Interface) error {
	js, err := utilyaml.ToJSON(CRD)
	if err != nil {
		return fmt.Errorf("reading the CRD: %w", err)
	}
	var obj map[string]any
	if err := json.Unmarshal(js, &obj); err != nil {
		return fmt.Errorf("reading the CRD: %w", err)
	}
	u := &unstructured.Unstructured{Object: obj}
	if _, err := dyn.Resource(crdGVR).Apply(ctx, u.GetName(), u, metav1.ApplyOptions{FieldManager: "weightd", Force: true}); err != nil {
		return fmt.Errorf("applying the CRD %s: %w", u.GetName(), err)
	}
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		got, err := dyn.Resource(crdGVR).Get(ctx, u.GetName(), metav1.GetOptions{})
		if err == nil && established(got) {
			// Established means served; a list confirms the
			// discovery caches of this client's server caught up.
			if _, err := dyn.Resource(GVR).List(ctx, metav1.ListOptions{Limit: 1}); err == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the CRD %s to be established: %w", u.GetName(), ctx.Err())
		case <-t.C:
		}
	}
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

// RemoveEntry removes node's entry from the status of the policy named
// name, on behalf of that node: an apply, as the node's field manager, that
// no longer names it. It is for entries left by nodes deleted from the
// cluster (the agent removes its own entry when its node stops matching).
// A policy that does not exist is not an error. The counts are corrected by
// the agents of the remaining nodes.
func RemoveEntry(ctx context.Context, dyn dynamic.Interface, name, node string) error {
	obj := applyObject(name, nil)
	_, err := dyn.Resource(GVR).ApplyStatus(ctx, name, obj, metav1.ApplyOptions{FieldManager: FieldManager(node), Force: true})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("removing the entry of node %s from policy %s: %w", node, name, err)
	}
	return nil
}
