package extender

import (
	"bytes"
	"encoding/json"
	"testing"

	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

// FuzzDecodeArgs feeds the request decoding path, and what decodes to
// prioritize and filter: nothing panics, scores stay in range, filter keeps
// a subset of the candidates, and the answer decodes as an
// ExtenderFilterResult's shape.
func FuzzDecodeArgs(f *testing.F) {
	nodes := cluster(f)
	c := newTestCache(f, nodes)
	h, err := NewHandler(c)
	if err != nil {
		f.Fatal(err)
	}
	for _, a := range []extenderv1.ExtenderArgs{
		namesArgs(mkPod(warm(refA+","+refB)), nodeNames(nodes)...),
		nodesArgs(mkPod(warm(refA+","+refU)), nodes),
		nodesArgs(mkPod(map[string]string{"weightd.io/prefetch-images": "true"}, "nginx:1.25", "bad image!"), nodes[:2]),
	} {
		b, err := json.Marshal(a)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte(`{"pod":{"metadata":{"annotations":{"weightd.io/models":"hf://a/b","weightd.io/require-warm":"1"}}},"nodes":{"items":[{"metadata":{"name":"x","annotations":{"weightd.io/cache":"{\"v\":1}"}},"status":{"images":[{"names":["a"],"sizeBytes":-1}]}}]}}`))
	f.Add([]byte(`{"Pod":{},"NodeNames":null,"Nodes":null}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		a, err := decodeArgs(bytes.NewReader(body))
		if err != nil {
			return
		}
		list, perr := h.prioritize(a)
		if perr == nil {
			for _, hp := range list {
				if hp.Score < extenderv1.MinExtenderPriority || hp.Score > extenderv1.MaxExtenderPriority {
					t.Fatalf("score %d of %q out of range", hp.Score, hp.Host)
				}
			}
		}
		res, ferr := h.filter(a)
		if ferr != nil {
			return
		}
		b, err := json.Marshal(res)
		if err != nil {
			t.Fatalf("filter result does not encode: %v", err)
		}
		// Node objects pass back verbatim (the scheduler gets what it
		// sent), so only the shape is checked, not each Node.
		var back struct {
			Nodes *struct {
				Items []json.RawMessage `json:"items"`
			}
			NodeNames                  *[]string
			FailedNodes                extenderv1.FailedNodesMap
			FailedAndUnresolvableNodes extenderv1.FailedNodesMap
			Error                      string
		}
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatalf("filter result does not decode: %v\n%s", err, b)
		}
		if back.Error != "" {
			t.Fatalf("filter set Error %q", back.Error)
		}
		names, _, cerr := a.candidates()
		if cerr != nil {
			return
		}
		if back.Nodes != nil && len(back.Nodes.Items) > len(names) {
			t.Fatalf("filter passed %d of %d nodes", len(back.Nodes.Items), len(names))
		}
		if back.NodeNames == nil {
			return
		}
		candidate := make(map[string]bool, len(names))
		for _, n := range names {
			candidate[n] = true
		}
		for _, n := range *back.NodeNames {
			if !candidate[n] {
				t.Fatalf("filter kept %q, not a candidate", n)
			}
		}
	})
}
