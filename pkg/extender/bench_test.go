package extender

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/weightd/weightd/pkg/nodestate"
)

// benchCluster is n nodes of a ~20-model summary each, half of them holding
// the pod's models in part.
func benchCluster(b *testing.B, n int) []*corev1.Node {
	nodes := make([]*corev1.Node, n)
	for i := range nodes {
		opts := []nodeOpt{}
		var entries []nodestate.Entry
		for j := range 20 {
			ref := fmt.Sprintf("hf://org/m%02d@main", (i+j)%60)
			entries = append(entries, entry(ref, int64(j%4)*gb, 3*gb))
		}
		opts = append(opts, summary(entries...))
		nodes[i] = mkNode(b, fmt.Sprintf("node-%05d", i), opts...)
	}
	return nodes
}

// BenchmarkPrioritize is one prioritize call in nodenames mode: decoding
// the request, scoring every node, encoding the answer.
func BenchmarkPrioritize(b *testing.B) {
	for _, n := range []int{100, 1000, 5000} {
		b.Run(fmt.Sprintf("nodes=%d", n), func(b *testing.B) {
			nodes := benchCluster(b, n)
			h, err := NewHandler(newTestCache(b, nodes))
			if err != nil {
				b.Fatal(err)
			}
			body, err := json.Marshal(namesArgs(mkPod(models("hf://org/m00@main, hf://org/m01@main, hf://org/m02@main")), nodeNames(nodes)...))
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				w := httptest.NewRecorder()
				h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/prioritize", bytes.NewReader(body)))
				if w.Code != http.StatusOK {
					b.Fatal(w.Body.String())
				}
			}
		})
	}
}
