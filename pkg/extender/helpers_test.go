package extender

import (
	"testing"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

// References of the tests, canonical.
const (
	refA     = "hf://org/llama@main"    // 100 GB, known from a summary
	refB     = "hf://org/lora@main"     // 10 GB
	refU     = "hf://org/unknown@main"  // no node knows its size
	refV     = "hf://org/unknown2@main" // nor this one's
	imgNginx = "oci://docker.io/library/nginx:1.25"
	gb       = int64(1e9)
	digestX  = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
)

type nodeOpt func(t testing.TB, n *corev1.Node)

// mkNode builds a Node as an agent and the kubelet leave it.
func mkNode(t testing.TB, name string, opts ...nodeOpt) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: "1", Labels: map[string]string{"kubernetes.io/hostname": name}}}
	for _, o := range opts {
		o(t, n)
	}
	return n
}

// ready labels ref ready.
func ready(ref string) nodeOpt {
	return func(_ testing.TB, n *corev1.Node) { n.Labels[nodestate.Label(ref)] = nodestate.LabelReady }
}

// entry is a summary entry for ref.
func entry(ref string, bytes, total int64) nodestate.Entry {
	state := nodestate.StateFetching
	if total > 0 && bytes == total {
		state = nodestate.StateReady
	}
	return nodestate.Entry{Key: nodestate.Key(ref), Ref: ref, State: state, Bytes: bytes, Total: total}
}

// summary sets the node's summary annotation.
func summary(entries ...nodestate.Entry) nodeOpt {
	return func(t testing.TB, n *corev1.Node) {
		s, err := nodestate.Summary{Entries: entries}.Encode()
		require.NoError(t, err)
		annotate(nodestate.SummaryAnnotation, s)(t, n)
	}
}

func annotate(k, v string) nodeOpt {
	return func(_ testing.TB, n *corev1.Node) {
		if n.Annotations == nil {
			n.Annotations = map[string]string{}
		}
		n.Annotations[k] = v
	}
}

// image lists an image in the node's status, as the kubelet does.
func image(size int64, names ...string) nodeOpt {
	return func(_ testing.TB, n *corev1.Node) {
		n.Status.Images = append(n.Status.Images, corev1.ContainerImage{Names: names, SizeBytes: size})
	}
}

// mkPod builds a pod with weightd annotations and container images.
func mkPod(ann map[string]string, images ...string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", Annotations: ann}}
	for _, img := range images {
		p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "c", Image: img})
	}
	return p
}

// models is the annotations of a pod asking for refs.
func models(refs string) map[string]string { return map[string]string{podrequest.Models: refs} }

// warm is the annotations of a pod requiring refs warm.
func warm(refs string) map[string]string {
	return map[string]string{podrequest.Models: refs, podrequest.RequireWarm: "true"}
}

// cluster is the nodes most tests score.
func cluster(t testing.TB) []*corev1.Node {
	return []*corev1.Node{
		mkNode(t, "full", summary(entry(refA, 100*gb, 100*gb)), ready(refB), ready(refA)),
		mkNode(t, "half-a", summary(entry(refA, 50*gb, 100*gb))),
		mkNode(t, "b", summary(entry(refB, 10*gb, 10*gb)), ready(refB)),
		mkNode(t, "none"),
		mkNode(t, "label-a", ready(refA)), // summary truncated: only the label says so
		mkNode(t, "img", image(30*gb, "docker.io/library/nginx:1.25", "docker.io/library/nginx@"+digestX)),
		mkNode(t, "unknown-u", ready(refU)),
		mkNode(t, "bad-summary", annotate(nodestate.SummaryAnnotation, `{"v":1,"entries":[{"key":"x","bytes":5,"total":2}]}`), ready(refB)),
	}
}

// newTestCache is a cache holding nodes.
func newTestCache(t testing.TB, nodes []*corev1.Node) *Cache {
	c := NewCache()
	for _, n := range nodes {
		_ = c.Set(n)
	}
	return c
}
