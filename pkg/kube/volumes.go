package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/csi"
)

// VolumeAnnotationPrefix starts the pod annotation that names what a model
// volume resolved to, one per volume: volumes.weightd.io/<volume> is
// hf://org/name@<commit> for a volume that asked for hf://org/name@main.
const VolumeAnnotationPrefix = "volumes.weightd.io/"

// ReasonModelVolumeReady (Normal, on the pod): a model volume is mounted,
// and which revision it holds.
const ReasonModelVolumeReady = "ModelVolumeReady"

// podVolumeQueue is how many announcements PodVolumes holds until Run
// writes them; more are dropped (the volume is mounted all the same).
const podVolumeQueue = 256

// PodVolumes tells pods what their model volumes resolved to: a branch is
// resolved once, when the volume is published, and the pod's annotation and
// an Event name the commit it got.
type PodVolumes struct {
	client kubernetes.Interface
	node   string
	log    *slog.Logger
	shared *Shared // nil: its own recorder
	queue  chan csi.Published
}

// NewPodVolumes returns the announcer of node's model volumes, recording
// Events through shared (nil: a recorder of its own). It starts nothing:
// Run writes what Announce queues.
func NewPodVolumes(client kubernetes.Interface, node string, shared *Shared, log *slog.Logger) (*PodVolumes, error) {
	if client == nil || node == "" {
		return nil, errors.New("kube: pod volumes need a client and a node name")
	}
	return &PodVolumes{client: client, node: node, log: log, shared: shared, queue: make(chan csi.Published, podVolumeQueue)}, nil
}

// Announce queues p and returns at once (csi.Config.Announce).
func (v *PodVolumes) Announce(_ context.Context, p csi.Published) {
	select {
	case v.queue <- p:
	default:
		v.log.Warn("dropping a model volume's announcement: too many queued", "pod", p.Namespace+"/"+p.Pod, "volume", p.Volume)
	}
}

// Run writes the queued announcements until ctx ends. A pod gone since is
// skipped; an API server that fails costs the annotation, never the volume.
func (v *PodVolumes) Run(ctx context.Context) error {
	recorder, stop := v.shared.recorder(ctx, v.client, v.node)
	defer stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case p := <-v.queue:
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: p.Namespace, Name: p.Pod, UID: types.UID(p.PodUID)}}
			if key := VolumeAnnotationPrefix + p.Volume; p.Volume != "" && len(validation.IsQualifiedName(key)) == 0 {
				if err := patchAnnotations(ctx, v.client, pod, map[string]any{key: p.Resolved}); err != nil {
					v.log.Warn("annotating a pod with its model volume's revision", "pod", p.Namespace+"/"+p.Pod, "volume", p.Volume, "err", err)
				}
			}
			ref := &corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: p.Namespace, Name: p.Pod, UID: pod.UID}
			recorder.Event(ref, corev1.EventTypeNormal, ReasonModelVolumeReady, volumeMessage(p))
		}
	}
}

// volumeMessage is the Event's text: what was asked, what it resolved to.
func volumeMessage(p csi.Published) string {
	what := p.Ref
	if p.Resolved != p.Ref {
		what += " resolved to " + p.Resolved
	}
	name := p.Volume
	if name == "" {
		name = "(unnamed)"
	}
	return fmt.Sprintf("volume %s: %s (%d files, %s)", name, what, p.Files, bytesize.IEC(p.Bytes))
}
