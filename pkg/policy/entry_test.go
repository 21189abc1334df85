package policy

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
)

func TestCRDCopyIsIdentical(t *testing.T) {
	t.Parallel()
	deployed, err := os.ReadFile(filepath.Join("..", "..", "deploy", "daemonset", "crd.yaml"))
	require.NoError(t, err)
	assert.True(t, bytes.Equal(CRD, deployed),
		"deploy/daemonset/crd.yaml differs from pkg/policy/crd.yaml: cp pkg/policy/crd.yaml deploy/daemonset/crd.yaml")
}

func TestMatches(t *testing.T) {
	t.Parallel()
	node := map[string]string{"pool": "h100", "zone": "a", "models.weightd.io/x": "ready"}
	tests := []struct {
		name string
		sel  *metav1.LabelSelector
		want bool
		err  bool
	}{
		{"nil selects nothing", nil, false, false},
		{"empty selects every node", &metav1.LabelSelector{}, true, false},
		{"labels match", &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "h100"}}, true, false},
		{"all labels must match", &metav1.LabelSelector{MatchLabels: map[string]string{"pool": "h100", "zone": "b"}}, false, false},
		{"In", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "zone", Operator: metav1.LabelSelectorOpIn, Values: []string{"a", "b"}}}}, true, false},
		{"NotIn", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "zone", Operator: metav1.LabelSelectorOpNotIn, Values: []string{"a"}}}}, false, false},
		{"Exists", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "models.weightd.io/x", Operator: metav1.LabelSelectorOpExists}}}, true, false},
		{"DoesNotExist", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "gpu", Operator: metav1.LabelSelectorOpDoesNotExist}}}, true, false},
		{"labels and expressions both", &metav1.LabelSelector{
			MatchLabels:      map[string]string{"pool": "h100"},
			MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "zone", Operator: metav1.LabelSelectorOpIn, Values: []string{"b"}}}}, false, false},
		{"bad operator", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "zone", Operator: "Near"}}}, false, true},
		{"In without values", &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: "zone", Operator: metav1.LabelSelectorOpIn}}}, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := Matches(tt.sel, node)
			if tt.err {
				assert.Error(t, err)
			} else {
				assert.NoError(t, err)
			}
			assert.Equal(t, tt.want, got)
		})
	}
	ok, err := Matches(&metav1.LabelSelector{MatchLabels: map[string]string{"pool": "h100"}}, nil)
	assert.NoError(t, err)
	assert.False(t, ok, "a node without labels")
}

func TestWants(t *testing.T) {
	t.Parallel()
	ws := Wants(Spec{
		Models: []string{
			"hf://org/model@main",
			"hf://org/model", // the same once canonical
			"https://s3.example/bucket/model.json?X-Amz-Signature=secret",
			"https://host/dir/", // no file
			"https://host/x?X-Amz-Signature=secret&bad path",
		},
		Images: []string{"nginx", "docker.io/library/nginx:latest", "Not/A/Valid:Image:Name"},
	})
	require.Len(t, ws, 6)
	assert.Equal(t, Want{Ref: "hf://org/model@main", Shown: "hf://org/model@main"}, ws[0])
	assert.Equal(t, "https://s3.example/bucket/model.json?X-Amz-Signature=secret", ws[1].Ref, "submitted with its query")
	assert.Equal(t, "https://s3.example/bucket/model.json?REDACTED", ws[1].Shown, "shown without it")
	assert.Error(t, ws[2].Err)
	assert.Equal(t, "https://host/dir/", ws[2].Shown)
	assert.Error(t, ws[3].Err)
	assert.Equal(t, "https://host/x?REDACTED", ws[3].Shown, "a malformed reference's query is hidden too")
	assert.NotContains(t, ws[3].Err.Error()+ws[2].Err.Error(), "secret&bad")
	assert.Equal(t, Want{Ref: "oci://docker.io/library/nginx:latest", Shown: "oci://docker.io/library/nginx:latest", Image: true}, ws[4])
	assert.True(t, ws[5].Image)
	assert.ErrorIs(t, ws[5].Err, ref.ErrInvalid)
	assert.Contains(t, ws[5].Err.Error(), "parsing image")
}

func TestCut(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "abc", cut("abc", 3))
	s := cut(strings.Repeat("ä", 100), 20)
	assert.LessOrEqual(t, len(s), 20)
	assert.True(t, strings.HasSuffix(s, "…"))
	assert.NotContains(t, s, "\uFFFD")
	for _, r := range s {
		assert.NotEqual(t, '\uFFFD', r)
	}
}

func TestBuildEntry(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 2, 17, 0, 0, 123, time.FixedZone("x", 3600))
	e := BuildEntry("gpu-1", 4, []RefState{
		{Shown: "hf://a/b@main", State: prefetch.StateReady, Bytes: 100},
		{Shown: "hf://a/c@main", State: prefetch.StateFetching, Bytes: 30},
		{Shown: "hf://a/d@main", State: prefetch.StateQueued},
		{Shown: "oci://r/app:v1", State: prefetch.StateImporting, Bytes: 5},
		{Shown: "hf://a/e@main", State: prefetch.StateFailed, Reason: strings.Repeat("x", 2000)},
	}, now)
	assert.Equal(t, "gpu-1", e.Name)
	assert.Equal(t, NodeFailed, e.State, "any failure makes the node failed")
	assert.Equal(t, []string{"hf://a/b@main"}, e.Ready)
	assert.Equal(t, []string{"hf://a/c@main", "hf://a/d@main", "oci://r/app:v1"}, e.Fetching)
	require.Len(t, e.Failed, 1)
	assert.LessOrEqual(t, len(e.Failed[0].Reason), MaxReasonLen)
	assert.Equal(t, int64(135), e.Bytes)
	assert.Equal(t, int64(4), e.ObservedGeneration)
	assert.Equal(t, time.Date(2026, 12, 2, 16, 0, 0, 0, time.UTC), e.Updated.Time, "UTC, whole seconds")

	e = BuildEntry("gpu-1", 1, []RefState{{Shown: "a", State: prefetch.StateReady}, {Shown: "b", State: prefetch.StateResolving}}, now)
	assert.Equal(t, NodeFetching, e.State)
	e = BuildEntry("gpu-1", 1, []RefState{{Shown: "a", State: prefetch.StateReady}}, now)
	assert.Equal(t, NodeReady, e.State)

	later := BuildEntry("gpu-1", 1, []RefState{{Shown: "a", State: prefetch.StateReady}}, now.Add(time.Hour))
	assert.True(t, sameEntry(e, later), "the time of writing does not make an entry differ")
	assert.False(t, sameEntry(e, BuildEntry("gpu-1", 2, []RefState{{Shown: "a", State: prefetch.StateReady}}, now)))
}

func TestEntryRoundTrip(t *testing.T) {
	t.Parallel()
	p := &PrefetchPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Generation: 3, UID: "uid-p"},
		Spec:       Spec{NodeSelector: &metav1.LabelSelector{}, Models: []string{"hf://a/b@main"}},
		Status:     Status{NodeCount: 2, ReadyNodes: 1, FailedNodes: 1},
	}
	u, err := ToUnstructured(p)
	require.NoError(t, err)
	assert.Equal(t, APIVersion, u.GetAPIVersion())
	assert.Equal(t, Kind, u.GetKind())
	back, err := FromUnstructured(u)
	require.NoError(t, err)
	assert.True(t, back.Spec.Pinned(), "pin defaults to true")
	assert.Equal(t, p.Status, back.Status)

	e := BuildEntry("n2", 3, []RefState{{Shown: "hf://a/b@main", State: prefetch.StateFailed, Reason: "404"}}, time.Now())
	obj, err := NodeStatusObject(p, e)
	require.NoError(t, err)
	assert.Equal(t, "p.n2", obj.GetName())
	assert.Equal(t, map[string]string{PolicyLabel: "p", NodeLabel: "n2"}, obj.GetLabels())
	require.Len(t, obj.GetOwnerReferences(), 1)
	assert.Equal(t, metav1.OwnerReference{APIVersion: APIVersion, Kind: Kind, Name: "p", UID: "uid-p"}, obj.GetOwnerReferences()[0])
	n, err := NodeFromUnstructured(obj)
	require.NoError(t, err)
	assert.True(t, sameEntry(e, n.Status))
	assert.Equal(t, int32(1), n.Status.FailedCount)

	// The leader's informer keeps what the counts need.
	slim, err := countedFields(obj)
	require.NoError(t, err)
	owner, c, ok := counted(slim.(*unstructured.Unstructured))
	assert.True(t, ok)
	assert.Equal(t, p.UID, owner)
	assert.Equal(t, NodeStatus{Name: "n2", State: NodeFailed, ObservedGeneration: 3}, c)
}

func TestNodeObjectName(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "llama.gpu-1", NodeObjectName("llama", "gpu-1"))
	assert.Equal(t, "gpu-1", LabelValue("gpu-1"))
	dotted := NodeObjectName("team.llama", "gpu-1")
	assert.Regexp(t, `^team\.llama\.gpu-1-[0-9a-f]{16}$`, dotted, "a dotted policy's names are hashed")
	long := strings.Repeat("n", 253)
	for _, c := range []struct{ got, other string }{
		{NodeObjectName("llama", long), NodeObjectName("llama", long[:252]+"m")},
		{NodeObjectName(long, "a"), NodeObjectName(long, "b")},
		{NodeObjectName("a.b", "c"), NodeObjectName("a", "b.c")},
	} {
		assert.LessOrEqual(t, len(c.got), 253)
		assert.Empty(t, validation.IsDNS1123Subdomain(c.got), c.got)
		assert.NotEqual(t, c.got, c.other, "names stay apart")
	}
	// A cut that would end in a dot or dash.
	dotted = strings.Repeat("a.", 40)
	v := LabelValue(dotted)
	assert.LessOrEqual(t, len(v), 63)
	assert.Empty(t, validation.IsValidLabelValue(v), v)
	assert.Equal(t, v, LabelValue(dotted), "stable")
	assert.NotEqual(t, v, LabelValue(dotted+"b"))
}

func TestCounts(t *testing.T) {
	t.Parallel()
	nodes := []NodeStatus{
		{Name: "a", State: NodeReady, ObservedGeneration: 2},
		{Name: "b", State: NodeReady, ObservedGeneration: 1}, // not at the current generation
		{Name: "c", State: NodeFetching, ObservedGeneration: 2},
		{Name: "d", State: NodeFailed, ObservedGeneration: 2},
	}
	n, r, f := Counts(nodes, 2)
	assert.Equal(t, [3]int32{4, 1, 1}, [3]int32{n, r, f})
	n, r, f = Counts(nil, 1)
	assert.Equal(t, [3]int32{0, 0, 0}, [3]int32{n, r, f})
}

func TestFieldManager(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "weightd-node-gpu-17", FieldManager("gpu-17"))
	long := strings.Repeat("n", 253)
	m := FieldManager(long)
	assert.Len(t, m, 128)
	assert.True(t, strings.HasPrefix(m, "weightd-node-nnn"))
	assert.NotEqual(t, m, FieldManager(long[:252]+"m"), "long names stay apart")
	assert.Equal(t, m, FieldManager(long), "stable")
	assert.Equal(t, "policy/llama", PinOwner("llama"))
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	assert.Equal(t, time.Minute, backoff(time.Minute, time.Hour, 1))
	assert.Equal(t, 2*time.Minute, backoff(time.Minute, time.Hour, 2))
	assert.Equal(t, 32*time.Minute, backoff(time.Minute, time.Hour, 6))
	assert.Equal(t, time.Hour, backoff(time.Minute, time.Hour, 7))
	assert.Equal(t, time.Hour, backoff(time.Minute, time.Hour, 1000))
}

func TestDirBlobs(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	blobs := filepath.Join(root, "blobs", "sha256")
	require.NoError(t, os.MkdirAll(blobs, 0o755))
	d1 := digest.FromString("one")
	d2 := digest.FromString("two")
	for _, d := range []digest.Digest{d1, d2} {
		require.NoError(t, os.WriteFile(filepath.Join(blobs, d.Encoded()), nil, 0o444))
	}
	snap := filepath.Join(root, "models", "models--org--m", "snapshots", "rev")
	require.NoError(t, os.MkdirAll(filepath.Join(snap, "sub"), 0o755))
	require.NoError(t, os.Symlink("../../../../blobs/sha256/"+d1.Encoded(), filepath.Join(snap, "config.json")))
	require.NoError(t, os.Symlink("../../../../../blobs/sha256/"+d2.Encoded(), filepath.Join(snap, "sub", "w.safetensors")))
	require.NoError(t, os.Symlink("/etc/passwd", filepath.Join(snap, "stray")))
	require.NoError(t, os.Symlink("../blobs/sha256/nothex", filepath.Join(snap, "odd")))
	require.NoError(t, os.WriteFile(filepath.Join(snap, "README"), nil, 0o644))

	got, err := dirBlobs(snap)
	require.NoError(t, err)
	assert.ElementsMatch(t, []digest.Digest{d1, d2}, got)

	got, err = dirBlobs(filepath.Join(root, "gone"))
	assert.NoError(t, err)
	assert.Empty(t, got)
	got, err = dirBlobs("")
	assert.NoError(t, err)
	assert.Empty(t, got)
}
