// Package podcgroup tells which Kubernetes pod and container a process or a
// cgroup belongs to, from the cgroup path the kubelet gives it.
//
// The kubelet names a pod's cgroup after its UID and QoS class, under either
// cgroup driver:
//
//	systemd:  /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope
//	cgroupfs: /kubepods/burstable/pod<uid>/<id>
//
// Guaranteed pods sit directly under kubepods; the container's part names
// the runtime (cri-containerd-, crio-, docker-) under systemd and is the bare
// container ID under cgroupfs. Only UIDs come out of here: mapping a UID to
// a namespace and name is the Kubernetes watcher's job.
package podcgroup
