// Command e2e prints the line of the real-kubelet end-to-end test
// (test/e2e, TestKubelet) for dashboards to watch:
//
//	{"bench":"kubelet-e2e","nodes":1,"image_via_mirror":true,"model_by_name":true,"pod_ready_s":…,"image_pull_s":…,"csi_model_by_name":true,"csi_pod_running_s":…,"plain_pod_running_s":…,"csi_peer_model_bytes":…,"csi_peer_link_mbit":…,"csi_peer_s_over_b":…,"csi_peer_pod_running_s":…}
//
// image_via_mirror: the kubelet's CRI pull of a pod's image went through
// weightd's mirror (its bytes counted there, one copy from the registry);
// model_by_name: the example pod's container found its model by name and
// revision in the node's Hugging Face cache, offline, with every byte right;
// pod_ready_s: that pod's creation to its container's success (the init
// container waiting on the agent's download included); image_pull_s: the
// first pod's creation to Running, its 16 MiB image pulled through the
// mirror; csi_model_by_name: the CSI example pod (Pod Security restricted)
// read its model by name through the volume's hub cache; csi_pod_running_s
// and plain_pod_running_s: the median of three creations to Running of a pod
// with the CSI volume of a model already on the node and of the same pod
// without it, alternating in the same run (the volume's cost is the
// difference); csi_peer_*: a pod with the CSI volume of a model that only a
// peer's agent holds, over a link shaped to csi_peer_link_mbit: the model's
// bytes, their time on that link (s_over_b) and the pod's creation to Running
// (nodes counts kubelets, not that peer). The test does the work, so that the line is only printed when
// every check passes; it needs what the test needs (root, `make test-deps`).
//
//	go run ./bench/e2e
package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

func main() {
	cmd := exec.Command("go", "test", "-v", "-count=1", "-run", "^TestKubelet$", "./test/e2e")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	sc := bufio.NewScanner(&out)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, `{"bench":"kubelet-e2e"`) {
			fmt.Println(line)
			if err == nil {
				return
			}
		}
	}
	os.Stderr.Write(out.Bytes())
	fmt.Fprintln(os.Stderr, "e2e: the test failed:", err)
	os.Exit(1)
}
