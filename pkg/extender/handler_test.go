package extender

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/weightd/weightd/pkg/podrequest"
)

// testServer serves a handler over the cache of nodes.
func testServer(t *testing.T, c *Cache, opts ...Option) (*httptest.Server, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	h, err := NewHandler(c, append([]Option{WithRegisterer(reg), WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))}, opts...)...)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv, reg
}

// post sends v as JSON to the verb and decodes the answer into out.
func post(t *testing.T, srv *httptest.Server, verb string, v, out any) {
	t.Helper()
	body, err := json.Marshal(v)
	require.NoError(t, err)
	resp, err := http.Post(srv.URL+"/"+verb, "application/json", bytes.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	require.NoError(t, json.Unmarshal(b, out), "%s", b)
}

// nodesArgs is ExtenderArgs in nodes mode (nodeCacheCapable: false).
func nodesArgs(pod *corev1.Pod, nodes []*corev1.Node) extenderv1.ExtenderArgs {
	list := &corev1.NodeList{}
	for _, n := range nodes {
		list.Items = append(list.Items, *n)
	}
	return extenderv1.ExtenderArgs{Pod: pod, Nodes: list}
}

// namesArgs is ExtenderArgs in nodenames mode (nodeCacheCapable: true).
func namesArgs(pod *corev1.Pod, names ...string) extenderv1.ExtenderArgs {
	return extenderv1.ExtenderArgs{Pod: pod, NodeNames: &names}
}

func nodeNames(nodes []*corev1.Node) []string {
	var out []string
	for _, n := range nodes {
		out = append(out, n.Name)
	}
	return out
}

func priorities(l extenderv1.HostPriorityList) map[string]int64 {
	m := map[string]int64{}
	for _, hp := range l {
		m[hp.Host] = hp.Score
	}
	return m
}

func TestPrioritize(t *testing.T) {
	t.Parallel()
	nodes := cluster(t)
	pod := mkPod(models(refA + "," + refB))
	want := map[string]int64{"full": 10, "half-a": 5, "b": 1, "none": 0, "label-a": 9, "img": 0, "unknown-u": 0, "bad-summary": 1}

	t.Run("nodenames", func(t *testing.T) {
		t.Parallel()
		srv, reg := testServer(t, newTestCache(t, nodes))
		var got extenderv1.HostPriorityList
		post(t, srv, VerbPrioritize, namesArgs(pod, append(nodeNames(nodes), "not-in-cache")...), &got)
		assert.Equal(t, len(nodes)+1, len(got))
		want := maps.Clone(want)
		want["not-in-cache"] = 0
		assert.Equal(t, want, priorities(got))
		assert.Equal(t, 1.0, metric(t, reg, "weightd_extender_request_seconds"))
		assert.Equal(t, float64(len(nodes)), metric(t, reg, "weightd_extender_nodes"))
	})
	t.Run("nodes", func(t *testing.T) {
		t.Parallel()
		// An empty cache: every node's state comes from the request,
		// sizes included.
		srv, _ := testServer(t, NewCache())
		var got extenderv1.HostPriorityList
		post(t, srv, VerbPrioritize, nodesArgs(pod, nodes), &got)
		assert.Equal(t, want, priorities(got))
	})
	t.Run("nodes, newer than the cache", func(t *testing.T) {
		t.Parallel()
		stale := newTestCache(t, []*corev1.Node{mkNode(t, "full"), mkNode(t, "none", ready(refA))})
		srv, _ := testServer(t, stale)
		fresh := cluster(t)
		for _, n := range fresh {
			n.ResourceVersion = "2"
		}
		var got extenderv1.HostPriorityList
		post(t, srv, VerbPrioritize, nodesArgs(pod, fresh), &got)
		assert.Equal(t, want, priorities(got))
	})
	t.Run("a pod asking nothing is answered at once", func(t *testing.T) {
		t.Parallel()
		srv, _ := testServer(t, newTestCache(t, nodes))
		var got extenderv1.HostPriorityList
		post(t, srv, VerbPrioritize, namesArgs(mkPod(nil, "nginx"), nodeNames(nodes)...), &got)
		assert.Empty(t, got)
		// In nodes mode even with nodes the handler could not decode.
		raw := `{"Pod":{"metadata":{"name":"p"}},"Nodes":{"items":[{"metadata":{"name":7}}]}}`
		resp, err := http.Post(srv.URL+"/prioritize", "application/json", strings.NewReader(raw))
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.JSONEq(t, "[]", string(b))
	})
	t.Run("malformed annotations score 0 everywhere", func(t *testing.T) {
		t.Parallel()
		srv, reg := testServer(t, newTestCache(t, nodes))
		bad := mkPod(map[string]string{podrequest.Models: refA + ", ftp://nope"})
		var got extenderv1.HostPriorityList
		post(t, srv, VerbPrioritize, namesArgs(bad, nodeNames(nodes)...), &got)
		require.Len(t, got, len(nodes))
		for _, hp := range got {
			assert.Zero(t, hp.Score, hp.Host)
		}
		assert.Equal(t, 1.0, metric(t, reg, "weightd_extender_invalid_pods_total"))
	})
}

// metric sums the values of metric family name in reg: gauges, counters
// and histogram sample counts.
func metric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var v float64
		for _, m := range mf.GetMetric() {
			v += m.GetGauge().GetValue() + m.GetCounter().GetValue() + float64(m.GetHistogram().GetSampleCount())
		}
		return v
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}

func TestFilter(t *testing.T) {
	t.Parallel()
	nodes := cluster(t)
	c := newTestCache(t, nodes)
	warmPod := mkPod(warm(refA + "," + refB))

	t.Run("nodenames", func(t *testing.T) {
		t.Parallel()
		srv, _ := testServer(t, c)
		var got extenderv1.ExtenderFilterResult
		post(t, srv, VerbFilter, namesArgs(warmPod, append(nodeNames(nodes), "ghost")...), &got)
		require.NotNil(t, got.NodeNames)
		assert.Equal(t, []string{"full"}, *got.NodeNames)
		assert.Nil(t, got.Nodes)
		assert.Empty(t, got.Error)
		assert.Len(t, got.FailedAndUnresolvableNodes, len(nodes))
		assert.Contains(t, got.FailedAndUnresolvableNodes["half-a"], "hf://org/llama@main (50%)")
		assert.Contains(t, got.FailedAndUnresolvableNodes["ghost"], "not (yet) known")
	})
	t.Run("nodes", func(t *testing.T) {
		t.Parallel()
		srv, _ := testServer(t, NewCache())
		var got extenderv1.ExtenderFilterResult
		post(t, srv, VerbFilter, nodesArgs(warmPod, nodes), &got)
		require.NotNil(t, got.Nodes)
		require.Len(t, got.Nodes.Items, 1)
		// The node comes back whole, as the scheduler sent it.
		assert.Equal(t, *nodes[0], got.Nodes.Items[0])
		assert.Nil(t, got.NodeNames)
		assert.Contains(t, got.FailedAndUnresolvableNodes["label-a"], "hf://org/lora@main (absent)")
		assert.Len(t, got.FailedAndUnresolvableNodes, len(nodes)-1)
	})
	passAll := []struct {
		name string
		pod  *corev1.Pod
	}{
		{"pods not requiring warm nodes", mkPod(models(refA))},
		{"pods asking nothing", mkPod(map[string]string{podrequest.RequireWarm: "true"})},
		{"malformed annotations", mkPod(map[string]string{podrequest.Models: refA, podrequest.RequireWarm: "sometimes"})},
	}
	for _, tt := range passAll {
		t.Run(tt.name+" pass everywhere", func(t *testing.T) {
			t.Parallel()
			srv, _ := testServer(t, c)
			var got extenderv1.ExtenderFilterResult
			post(t, srv, VerbFilter, namesArgs(tt.pod, nodeNames(nodes)...), &got)
			assert.Equal(t, nodeNames(nodes), *got.NodeNames)
			assert.Empty(t, got.FailedNodes)
			assert.Empty(t, got.FailedAndUnresolvableNodes)

			got = extenderv1.ExtenderFilterResult{}
			post(t, srv, VerbFilter, nodesArgs(tt.pod, nodes), &got)
			require.NotNil(t, got.Nodes)
			require.Len(t, got.Nodes.Items, len(nodes))
			for i, n := range got.Nodes.Items {
				assert.Equal(t, *nodes[i], n)
			}
		})
	}
}

func TestHandlerRefuses(t *testing.T) {
	t.Parallel()
	srv, _ := testServer(t, NewCache(), WithMaxBodyBytes(4<<10))
	tests := []struct {
		name, method, path, body string
		code                     int
	}{
		{"not JSON", http.MethodPost, "/prioritize", "{", http.StatusBadRequest},
		{"no pod", http.MethodPost, "/filter", `{"NodeNames":["a"]}`, http.StatusBadRequest},
		{"no nodes", http.MethodPost, "/prioritize", `{"Pod":{}}`, http.StatusBadRequest},
		{"bad nodes", http.MethodPost, "/filter", `{"Pod":{"metadata":{"annotations":{"weightd.io/models":"hf://a/b","weightd.io/require-warm":"true"}}},"Nodes":{"items":[{}]}}`, http.StatusBadRequest},
		{"too large", http.MethodPost, "/prioritize", `{"Pod":{"metadata":{"name":"` + strings.Repeat("x", 5<<10) + `"}},"NodeNames":[]}`, http.StatusRequestEntityTooLarge},
		{"GET", http.MethodGet, "/prioritize", "", http.StatusMethodNotAllowed},
		{"unknown verb", http.MethodPost, "/preempt", "{}", http.StatusNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequest(tt.method, srv.URL+tt.path, strings.NewReader(tt.body))
			require.NoError(t, err)
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, tt.code, resp.StatusCode)
		})
	}
}

func TestNewHandlerOptions(t *testing.T) {
	t.Parallel()
	_, err := NewHandler(nil)
	assert.Error(t, err)
	_, err = NewHandler(NewCache(), WithMaxBodyBytes(10))
	assert.Error(t, err)
	_, err = NewHandler(NewCache(), WithLogger(nil))
	assert.Error(t, err)
	reg := prometheus.NewRegistry()
	_, err = NewHandler(NewCache(), WithRegisterer(reg))
	require.NoError(t, err)
	_, err = NewHandler(NewCache(), WithRegisterer(reg))
	assert.Error(t, err, "registered twice")
}
