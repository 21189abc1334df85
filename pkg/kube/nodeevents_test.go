package kube

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// TestNodeEventsFakeAPI: Events queued before Run are recorded on the Node
// once it runs, named as the kubelet names its node (UID = name), in the
// default namespace, their messages cut to MaxNodeEventLen; a full queue
// drops Events rather than block.
func TestNodeEventsFakeAPI(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset()
	_, err := NewNodeEvents(client, "", nil)
	require.Error(t, err)
	ev, err := NewNodeEvents(client, "n1", nil)
	require.NoError(t, err)

	long := strings.Repeat("é", MaxNodeEventLen)
	require.True(t, ev.Event(corev1.EventTypeWarning, ReasonMirrorNotConfigured, long))
	for range nodeEventQueue - 1 {
		ev.Event(corev1.EventTypeNormal, ReasonMirrorConfigured, "again")
	}
	assert.False(t, ev.Event(corev1.EventTypeNormal, ReasonMirrorConfigured, "one too many"), "a full queue")

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- ev.Run(ctx) }()
	var warning *corev1.Event
	for deadline := time.Now().Add(30 * time.Second); warning == nil; {
		list, err := client.CoreV1().Events("default").List(t.Context(), metav1.ListOptions{})
		require.NoError(t, err)
		for i, e := range list.Items {
			if e.Reason == ReasonMirrorNotConfigured {
				warning = &list.Items[i]
			}
		}
		if warning == nil {
			require.False(t, time.Now().After(deadline), "no %s Event: %v", ReasonMirrorNotConfigured, list.Items)
			time.Sleep(20 * time.Millisecond)
		}
	}
	cancel()
	require.NoError(t, <-done)

	assert.Equal(t, corev1.EventTypeWarning, warning.Type)
	assert.Equal(t, corev1.ObjectReference{Kind: "Node", Name: "n1", UID: "n1"}, warning.InvolvedObject)
	assert.Equal(t, corev1.EventSource{Component: FieldManager, Host: "n1"}, warning.Source)
	assert.LessOrEqual(t, len(warning.Message), MaxNodeEventLen)
	assert.True(t, strings.HasPrefix(long, strings.TrimSuffix(warning.Message, "…")))
}
