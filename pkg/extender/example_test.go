package extender_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"

	"github.com/weightd/weightd/pkg/extender"
	"github.com/weightd/weightd/pkg/nodestate"
)

// The scheduler asks, in nodenames mode, how warm two nodes are for a pod
// that wants a model: one node holds it, the other a quarter of it. In a
// cluster a Watcher feeds the cache from the API server.
func Example() {
	const ref = "hf://org/llama@main"
	c := extender.NewCache()
	for name, bytes := range map[string]int64{"gpu-a": 100, "gpu-b": 25} {
		state := nodestate.StateFetching
		if bytes == 100 {
			state = nodestate.StateReady
		}
		sum, _ := nodestate.Summary{Entries: []nodestate.Entry{{Key: nodestate.Key(ref), Ref: ref, State: state, Bytes: bytes, Total: 100}}}.Encode()
		_ = c.Set(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{nodestate.SummaryAnnotation: sum}}})
	}
	h, _ := extender.NewHandler(c)
	srv := httptest.NewServer(h)
	defer srv.Close()

	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "llm", Annotations: map[string]string{"weightd.io/models": ref}}}
	body, _ := json.Marshal(extenderv1.ExtenderArgs{Pod: pod, NodeNames: &[]string{"gpu-a", "gpu-b", "gpu-c"}})
	resp, err := http.Post(srv.URL+"/prioritize", "application/json", bytes.NewReader(body))
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	var scores extenderv1.HostPriorityList
	_ = json.NewDecoder(resp.Body).Decode(&scores)
	for _, s := range scores {
		fmt.Println(s.Host, s.Score)
	}
	// Output:
	// gpu-a 10
	// gpu-b 3
	// gpu-c 0
}
