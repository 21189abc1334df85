package podcgroup

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const (
	uid  = "8d3f2a1c-5b6e-4c7d-9e0f-1a2b3c4d5e6f"
	uidU = "8d3f2a1c_5b6e_4c7d_9e0f_1a2b3c4d5e6f"
	cid  = "4f1e9c0b7a2d3e5f6a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f"
	// static is a static pod's UID: 32 hex digits, no dashes.
	static = "6a1b2c3d4e5f60718293a4b5c6d7e8f9"
)

func TestParse(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		path string
		want Pod
	}{
		{"systemd burstable containerd",
			"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope",
			Pod{UID: uid, ContainerID: cid, QoS: QoSBurstable}},
		{"systemd besteffort crio",
			"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uidU + ".slice/crio-" + cid + ".scope",
			Pod{UID: uid, ContainerID: cid, QoS: QoSBestEffort}},
		{"systemd guaranteed docker",
			"/kubepods.slice/kubepods-pod" + uidU + ".slice/docker-" + cid + ".scope",
			Pod{UID: uid, ContainerID: cid, QoS: QoSGuaranteed}},
		{"systemd crio conmon",
			"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidU + ".slice/crio-conmon-" + cid + ".scope",
			Pod{UID: uid, QoS: QoSBurstable}},
		{"systemd pod slice only",
			"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidU + ".slice",
			Pod{UID: uid, QoS: QoSBurstable}},
		{"systemd nested kubelet (kind)",
			"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope",
			Pod{UID: uid, ContainerID: cid, QoS: QoSBestEffort}},
		{"systemd sub-cgroup of the container",
			"/kubepods.slice/kubepods-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope/init",
			Pod{UID: uid, ContainerID: cid, QoS: QoSGuaranteed}},
		{"cgroupfs burstable",
			"/kubepods/burstable/pod" + uid + "/" + cid,
			Pod{UID: uid, ContainerID: cid, QoS: QoSBurstable}},
		{"cgroupfs besteffort",
			"/kubepods/besteffort/pod" + uid + "/" + cid,
			Pod{UID: uid, ContainerID: cid, QoS: QoSBestEffort}},
		{"cgroupfs guaranteed",
			"/kubepods/pod" + uid + "/" + cid,
			Pod{UID: uid, ContainerID: cid, QoS: QoSGuaranteed}},
		{"cgroupfs crio",
			"/kubepods/burstable/pod" + uid + "/crio-" + cid,
			Pod{UID: uid, ContainerID: cid, QoS: QoSBurstable}},
		{"cgroupfs under docker-in-docker",
			"/docker/" + cid + "/kubepods/besteffort/pod" + uid + "/" + cid,
			Pod{UID: uid, ContainerID: cid, QoS: QoSBestEffort}},
		{"cgroup namespace relative",
			"/../../kubepods-burstable.slice/kubepods-burstable-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope",
			Pod{UID: uid, ContainerID: cid, QoS: QoSBurstable}},
		{"static pod UID",
			"/kubepods/burstable/pod" + static + "/" + cid,
			Pod{UID: static, ContainerID: cid, QoS: QoSBurstable}},
		{"unknown container segment",
			"/kubepods/burstable/pod" + uid + "/not-a-container",
			Pod{UID: uid, QoS: QoSBurstable}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := Parse(tt.path)
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestParseNotPod(t *testing.T) {
	t.Parallel()
	for _, path := range []string{
		"",
		"/",
		"/system.slice/containerd.service",
		"/user.slice/user-1000.slice/session-2.scope",
		"/kubepods.slice",
		"/kubepods.slice/kubepods-burstable.slice",
		"/kubepods/burstable",
		"/kubepods/burstable/podnot-a-uid/" + cid,
		"/kubepods/other/pod" + uid + "/" + cid,
		"/pod" + uid + "/" + cid,
		"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uid + ".slice", // dashes, not underscores
		"/kubepods.slice/mykubepods-pod" + uidU + ".slice",
		"/kubepods.slice/kubepods-pod" + strings.ToUpper(uidU) + ".slice",
	} {
		_, err := Parse(path)
		assert.ErrorIs(t, err, ErrNotPod, "%q", path)
	}
}

func TestParseProcCgroup(t *testing.T) {
	t.Parallel()
	v2 := "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n"
	v1 := "12:memory:/kubepods/besteffort/pod" + uid + "/" + cid + "\n" +
		"11:cpu,cpuacct:/kubepods/besteffort/pod" + uid + "/" + cid + "\n" +
		"1:name=systemd:/kubepods/besteffort/pod" + uid + "/" + cid + "\n"
	tests := []struct {
		name, in string
		want     Pod
		err      error
	}{
		{"v2", v2, Pod{UID: uid, ContainerID: cid, QoS: QoSBurstable}, nil},
		{"v1", v1, Pod{UID: uid, ContainerID: cid, QoS: QoSBestEffort}, nil},
		{"hybrid prefers v2", "3:memory:/kubepods/besteffort/pod" + static + "/" + cid + "\n" + v2,
			Pod{UID: uid, ContainerID: cid, QoS: QoSBurstable}, nil},
		{"host process", "0::/system.slice/sshd.service\n", Pod{}, ErrNotPod},
		{"garbage", "no colons here\n\n::\n", Pod{}, ErrNotPod},
		{"empty", "", Pod{}, ErrNotPod},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParseProcCgroup(strings.NewReader(tt.in))
			if tt.err != nil {
				require.ErrorIs(t, err, tt.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.want, got)
		})
	}
}

func TestFromProc(t *testing.T) {
	t.Parallel()
	proc := t.TempDir()
	writeProcCgroup(t, proc, 4242, "0::/kubepods/pod"+uid+"/"+cid+"\n")
	got, err := FromProc(proc, 4242)
	require.NoError(t, err)
	assert.Equal(t, Pod{UID: uid, ContainerID: cid, QoS: QoSGuaranteed}, got)

	_, err = FromProc(proc, 1)
	require.ErrorIs(t, err, os.ErrNotExist)
}

// writeProcCgroup writes <proc>/<pid>/cgroup.
func writeProcCgroup(t *testing.T, proc string, pid int, content string) {
	t.Helper()
	dir := filepath.Join(proc, strconv.Itoa(pid))
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "cgroup"), []byte(content), 0o644))
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return fi.Sys().(*syscall.Stat_t).Ino
}

func TestResolver(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	podDir := filepath.Join(root, "kubepods.slice", "kubepods-burstable.slice", "kubepods-burstable-pod"+uidU+".slice")
	ctr := filepath.Join(podDir, "cri-containerd-"+cid+".scope")
	require.NoError(t, os.MkdirAll(ctr, 0o755))
	sys := filepath.Join(root, "system.slice", "containerd.service")
	require.NoError(t, os.MkdirAll(sys, 0o755))
	// A file, not a cgroup: its inode must not resolve.
	file := filepath.Join(podDir, "memory.max")
	require.NoError(t, os.WriteFile(file, []byte("max\n"), 0o644))

	fileID := inode(t, file)

	r := NewResolver(root)
	got, err := r.FromCgroupID(inode(t, ctr))
	require.NoError(t, err)
	assert.Equal(t, Pod{UID: uid, ContainerID: cid, QoS: QoSBurstable}, got)

	got, err = r.FromCgroupID(inode(t, podDir))
	require.NoError(t, err)
	assert.Equal(t, Pod{UID: uid, QoS: QoSBurstable}, got)

	_, err = r.FromCgroupID(inode(t, sys))
	require.ErrorIs(t, err, ErrNotPod)
	_, err = r.FromCgroupID(fileID)
	require.ErrorIs(t, err, ErrUnknownCgroup)

	// A container made after the first walk is found by walking again.
	cid2 := strings.Repeat("ab", 32)
	ctr2 := filepath.Join(root, "kubepods", "besteffort", "pod"+uid, cid2)
	require.NoError(t, os.MkdirAll(ctr2, 0o755))
	got, err = r.FromCgroupID(inode(t, ctr2))
	require.NoError(t, err)
	assert.Equal(t, Pod{UID: uid, ContainerID: cid2, QoS: QoSBestEffort}, got)

	// A miss is remembered: the file's inode answers without a walk, even
	// once a walk could no longer run.
	require.NoError(t, os.RemoveAll(root))
	_, err = r.FromCgroupID(fileID)
	require.ErrorIs(t, err, ErrUnknownCgroup)
	// Known IDs still answer from the cache.
	_, err = r.FromCgroupID(r.idOf(t, "/kubepods/besteffort/pod"+uid+"/"+cid2))
	require.NoError(t, err)
	// A new miss walks, and the walk fails on the removed root.
	_, err = r.FromCgroupID(1 << 62)
	require.Error(t, err)
	assert.False(t, errors.Is(err, ErrUnknownCgroup))
}

func (r *Resolver) idOf(t *testing.T, rel string) uint64 {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, p := range r.byID {
		if p == rel {
			return id
		}
	}
	t.Fatalf("%s not in the cache", rel)
	return 0
}

func FuzzParse(f *testing.F) {
	f.Add("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope")
	f.Add("/kubepods/pod" + uid + "/" + cid)
	f.Add("0::/kubepods/besteffort/pod" + static + "/crio-" + cid + "\n1:name=systemd:/")
	f.Add("/kubepods-pod.slice/pod/")
	f.Fuzz(func(t *testing.T, s string) {
		pod, err := Parse(s)
		if err == nil {
			if !validUID(pod.UID) {
				t.Fatalf("Parse(%q) returned UID %q", s, pod.UID)
			}
			if pod.ContainerID != "" && !validContainerID(pod.ContainerID) {
				t.Fatalf("Parse(%q) returned container %q", s, pod.ContainerID)
			}
			switch pod.QoS {
			case QoSGuaranteed, QoSBurstable, QoSBestEffort:
			default:
				t.Fatalf("Parse(%q) returned QoS %q", s, pod.QoS)
			}
		} else if !errors.Is(err, ErrNotPod) {
			t.Fatalf("Parse(%q): %v", s, err)
		}
		if _, err := ParseProcCgroup(strings.NewReader(s)); err != nil && !errors.Is(err, ErrNotPod) {
			t.Fatalf("ParseProcCgroup(%q): %v", s, err)
		}
	})
}
