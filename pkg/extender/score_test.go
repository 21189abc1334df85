package extender

import (
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"github.com/weightd/weightd/pkg/nodestate"
	"github.com/weightd/weightd/pkg/podrequest"
)

// scores runs prioritize's scoring for pod over the cache's nodes.
func scores(t *testing.T, c *Cache, pod *corev1.Pod) map[string]int64 {
	t.Helper()
	req, err := (&wirePod{}).fromPod(pod).request()
	require.NoError(t, err)
	c.mu.RLock()
	defer c.mu.RUnlock()
	p := newPlan(req, c.total)
	out := map[string]int64{}
	for name, info := range c.nodes {
		out[name] = p.score(info)
	}
	return out
}

// fromPod copies what the extender reads of a typed pod.
func (p *wirePod) fromPod(pod *corev1.Pod) *wirePod {
	p.Metadata.Name, p.Metadata.Namespace, p.Metadata.Annotations = pod.Name, pod.Namespace, pod.Annotations
	for _, c := range pod.Spec.InitContainers {
		p.Spec.InitContainers = append(p.Spec.InitContainers, wireContainer{Image: c.Image})
	}
	for _, c := range pod.Spec.Containers {
		p.Spec.Containers = append(p.Spec.Containers, wireContainer{Image: c.Image})
	}
	return p
}

func TestScore(t *testing.T) {
	t.Parallel()
	c := newTestCache(t, cluster(t))
	prefetchImages := func(refs string) map[string]string {
		return map[string]string{podrequest.Models: refs, podrequest.PrefetchImages: "true"}
	}
	tests := []struct {
		name string
		pod  *corev1.Pod
		want map[string]int64 // nodes not listed score 0
	}{
		{
			// A weighs 100 GB, B 10 GB: half of A is 50/110.
			name: "two models weighted by size",
			pod:  mkPod(models(refA + "," + refB)),
			want: map[string]int64{"full": 10, "half-a": 5, "b": 1, "label-a": 9, "bad-summary": 1},
		},
		{
			name: "one model",
			pod:  mkPod(models(refA)),
			want: map[string]int64{"full": 10, "half-a": 5, "label-a": 10},
		},
		{
			// No node knows U's size: it weighs as much as A.
			name: "unknown size counts as an average reference",
			pod:  mkPod(models(refA + "," + refU)),
			want: map[string]int64{"full": 5, "half-a": 3, "label-a": 5, "unknown-u": 5},
		},
		{
			name: "no size known at all: references count equally",
			pod:  mkPod(models(refU + "," + refV)),
			want: map[string]int64{"unknown-u": 5},
		},
		{
			// nginx:1.25 weighs 30 GB (status.images), A 100 GB.
			name: "images by their kubelet-reported size",
			pod:  mkPod(prefetchImages(refA), "nginx:1.25"),
			want: map[string]int64{"full": 8, "half-a": 4, "label-a": 8, "img": 2},
		},
		{
			name: "image pinned by tag and digest matches the digest name",
			pod:  mkPod(prefetchImages(""), "nginx:1.26@"+digestX),
			want: map[string]int64{"img": 10},
		},
		{
			name: "images not asked for do not count",
			pod:  mkPod(models(refB), "nginx:1.25"),
			want: map[string]int64{"full": 10, "b": 10, "bad-summary": 10},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got := scores(t, c, tt.pod)
			for name, score := range got {
				assert.Equal(t, tt.want[name], score, "node %s", name)
			}
		})
	}
}

func TestScoreOf(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		f    float64
		want int64
	}{
		{0, 0}, {-1, 0}, {math.NaN(), 0}, {1e-9, 1}, {0.04, 1}, {0.15, 2}, {0.5, 5}, {0.949, 9}, {0.999, 9}, {1, 10}, {1.5, 10},
	} {
		assert.Equal(t, tt.want, scoreOf(tt.f), "fraction %v", tt.f)
	}
}

func TestMissing(t *testing.T) {
	t.Parallel()
	c := newTestCache(t, cluster(t))
	tests := []struct {
		name string
		ann  map[string]string
		want map[string]string // node → substring of its reason; "" passes
	}{
		{
			name: "two models",
			ann:  warm(refA + "," + refB),
			want: map[string]string{
				"full":    "",
				"half-a":  "not warm: hf://org/llama@main (50%), hf://org/lora@main (absent)",
				"label-a": "not warm: hf://org/lora@main (absent)",
				"none":    "hf://org/llama@main (absent)",
			},
		},
		{
			name: "a partial node without a known size",
			ann:  warm(refU),
			want: map[string]string{"unknown-u": "", "none": "hf://org/unknown@main (absent)"},
		},
		{
			name: "many missing are counted, not listed",
			ann:  warm("hf://o/m1,hf://o/m2,hf://o/m3,hf://o/m4,hf://o/m5"),
			want: map[string]string{"none": "(absent) and 2 more"},
		},
		{
			name: "presigned queries are redacted",
			ann:  warm("https://bucket.s3.example/model.bin?X-Amz-Signature=secret"),
			want: map[string]string{"none": "https://bucket.s3.example/model.bin?REDACTED (absent)"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			req, err := (&wirePod{}).fromPod(mkPod(tt.ann)).request()
			require.NoError(t, err)
			c.mu.RLock()
			defer c.mu.RUnlock()
			p := newPlan(req, c.total)
			for node, want := range tt.want {
				got := p.missing(c.nodes[node])
				if want == "" {
					assert.Empty(t, got, "node %s", node)
					continue
				}
				assert.Contains(t, got, want, "node %s", node)
				assert.NotContains(t, got, "secret")
			}
		})
	}
	req, err := podrequest.Parse(warm(refA), nil)
	require.NoError(t, err)
	p := newPlan(req, func(string) int64 { return 0 })
	assert.Contains(t, p.missing(nil), "not (yet) known")
}

func TestCache(t *testing.T) {
	t.Parallel()
	c := NewCache()
	require.NoError(t, c.Set(mkNode(t, "a", summary(entry(refA, 10*gb, 100*gb)))))
	require.NoError(t, c.Set(mkNode(t, "b", summary(entry(refA, 100*gb, 100*gb)))))
	c.mu.RLock()
	assert.Equal(t, 100*gb, c.total(nodestate.Key(refA)))
	c.mu.RUnlock()

	// An unchanged resource version is not recomputed.
	same := mkNode(t, "a")
	require.NoError(t, c.Set(same))
	c.mu.RLock()
	assert.Equal(t, 10*gb, c.nodes["a"].held[nodestate.Key(refA)].bytes)
	c.mu.RUnlock()

	// The size is known while any node knows it.
	c.Delete("a")
	c.mu.RLock()
	assert.Equal(t, 100*gb, c.total(nodestate.Key(refA)))
	c.mu.RUnlock()
	c.Delete("b")
	c.mu.RLock()
	assert.Zero(t, c.total(nodestate.Key(refA)))
	assert.Empty(t, c.totals)
	c.mu.RUnlock()
	assert.Zero(t, c.Len())

	// A malformed summary is reported; the labels still count.
	bad := mkNode(t, "bad", annotate(nodestate.SummaryAnnotation, "{not json"), ready(refB))
	err := c.Set(bad)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "node bad")
	c.mu.RLock()
	assert.True(t, c.nodes["bad"].held[nodestate.Key(refB)].ready)
	c.mu.RUnlock()

	require.Error(t, c.Set(nil))
	require.Error(t, c.Set(&corev1.Node{}))
}

func TestNodeInfoBounds(t *testing.T) {
	t.Parallel()
	n := mkNode(t, "many")
	for i := range 3 * maxImageNames {
		n.Status.Images = append(n.Status.Images, corev1.ContainerImage{Names: []string{"r.io/img" + strings.Repeat("x", i%7) + ":v"}, SizeBytes: 1})
	}
	n.Status.Images = append(n.Status.Images, corev1.ContainerImage{Names: []string{"sha256:" + strings.Repeat("b", 64), "UPPER/Case"}, SizeBytes: 1})
	info, err := newNodeInfo(fieldsOf(n))
	require.NoError(t, err)
	assert.LessOrEqual(t, len(info.held), maxImageNames)
}
