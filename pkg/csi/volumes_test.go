package csi

import "testing"

// The pod and volume come from the kubelet's target path; a target
// elsewhere names neither.
func TestPodAndVolumeFromTarget(t *testing.T) {
	for target, want := range map[string][2]string{
		"/var/lib/kubelet/pods/8d3f2a1c/volumes/kubernetes.io~csi/model/mount":    {"8d3f2a1c", "model"},
		"/var/lib/kubelet/pods/8d3f2a1c/volumes/kubernetes.io~csi/model/mount/":   {"8d3f2a1c", "model"},
		"/var/lib/kubelet/pods/8d3f2a1c/volumes/kubernetes.io~csi/pv-model/mount": {"8d3f2a1c", "pv-model"},
		"/var/lib/kubelet/pods/8d3f2a1c/volumes/kubernetes.io~empty-dir/m/mount":  {"", ""},
		"/var/lib/kubelet/plugins/8d3f2a1c/volumes/kubernetes.io~csi/model/mount": {"", "model"},
		"/mnt/model": {"", ""},
		"mount":      {"", ""},
	} {
		if uid, name := podUID(target), volumeName(target); uid != want[0] || name != want[1] {
			t.Errorf("%s: pod %q volume %q, want %q %q", target, uid, name, want[0], want[1])
		}
	}
}
