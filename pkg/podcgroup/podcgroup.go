package podcgroup

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ErrNotPod is returned for a cgroup path that is not a Kubernetes pod's.
var ErrNotPod = errors.New("not a pod's cgroup")

// QoS is a pod's Kubernetes quality-of-service class.
type QoS string

// The QoS classes, as Kubernetes spells them.
const (
	QoSGuaranteed QoS = "Guaranteed"
	QoSBurstable  QoS = "Burstable"
	QoSBestEffort QoS = "BestEffort"
)

// Pod is the pod, and the container within it, that a cgroup belongs to.
type Pod struct {
	// UID is the pod's UID with dashes, as the API server spells it.
	UID string
	// ContainerID is the runtime's container ID, without a runtime prefix;
	// empty for the pod's own cgroup (and a CRI-O conmon).
	ContainerID string
	QoS         QoS
}

// maxLineBytes bounds one line of /proc/<pid>/cgroup.
const maxLineBytes = 64 << 10

// runtimePrefixes are the prefixes of a container's systemd scope (and of
// CRI-O's cgroupfs directory), longest first so "crio-conmon-" wins over
// "crio-".
var runtimePrefixes = []string{"cri-containerd-", "crio-conmon-", "crio-", "docker-", "containerd-"}

// Parse returns the pod and container of a cgroup path, or ErrNotPod. The
// path may carry anything before the kubepods part (a nested kubelet's
// slice, a cgroup namespace's "/.."), and anything after the container's.
func Parse(path string) (Pod, error) {
	segs := strings.Split(path, "/")
	for i, seg := range segs {
		var (
			pod Pod
			ok  bool
		)
		if strings.HasSuffix(seg, ".slice") {
			pod, ok = systemdPod(seg)
		} else {
			pod, ok = cgroupfsPod(segs[:i], seg)
		}
		if !ok {
			continue
		}
		if i+1 < len(segs) {
			pod.ContainerID = containerID(segs[i+1])
		}
		return pod, nil
	}
	return Pod{}, fmt.Errorf("parsing cgroup path %q: %w", path, ErrNotPod)
}

// systemdPod parses a pod slice: [<prefix>-]kubepods[-<qos>]-pod<uid>.slice,
// the UID's dashes written as underscores.
func systemdPod(seg string) (Pod, bool) {
	name := strings.TrimSuffix(seg, ".slice")
	at := strings.LastIndex(name, "kubepods-")
	if at < 0 || (at > 0 && name[at-1] != '-') {
		return Pod{}, false
	}
	rest := name[at+len("kubepods-"):]
	qos := QoSGuaranteed
	switch {
	case strings.HasPrefix(rest, "burstable-"):
		qos, rest = QoSBurstable, rest[len("burstable-"):]
	case strings.HasPrefix(rest, "besteffort-"):
		qos, rest = QoSBestEffort, rest[len("besteffort-"):]
	}
	uid, ok := strings.CutPrefix(rest, "pod")
	if !ok || strings.Contains(uid, "-") {
		return Pod{}, false
	}
	uid = strings.ReplaceAll(uid, "_", "-")
	if !validUID(uid) {
		return Pod{}, false
	}
	return Pod{UID: uid, QoS: qos}, true
}

// cgroupfsPod parses a pod directory, pod<uid>, directly under kubepods
// (Guaranteed) or under kubepods/burstable or kubepods/besteffort.
func cgroupfsPod(parents []string, seg string) (Pod, bool) {
	uid, ok := strings.CutPrefix(seg, "pod")
	if !ok || !validUID(uid) || len(parents) == 0 {
		return Pod{}, false
	}
	parent := parents[len(parents)-1]
	if parent == "kubepods" {
		return Pod{UID: uid, QoS: QoSGuaranteed}, true
	}
	if len(parents) < 2 || parents[len(parents)-2] != "kubepods" {
		return Pod{}, false
	}
	switch parent {
	case "burstable":
		return Pod{UID: uid, QoS: QoSBurstable}, true
	case "besteffort":
		return Pod{UID: uid, QoS: QoSBestEffort}, true
	}
	return Pod{}, false
}

// containerID returns the container ID a container's cgroup directory
// names, or "" when it names none (or a CRI-O conmon, which runs beside the
// container rather than in it).
func containerID(seg string) string {
	name := strings.TrimSuffix(seg, ".scope")
	for _, p := range runtimePrefixes {
		if id, ok := strings.CutPrefix(name, p); ok {
			if p == "crio-conmon-" {
				return ""
			}
			name = id
			break
		}
	}
	if !validContainerID(name) {
		return ""
	}
	return name
}

// validUID reports whether s is a pod UID: a UUID, or the 32 hex digits the
// kubelet gives a static pod.
func validUID(s string) bool {
	switch len(s) {
	case 32:
		return isHex(s)
	case 36:
		for i := range len(s) {
			if i == 8 || i == 13 || i == 18 || i == 23 {
				if s[i] != '-' {
					return false
				}
			} else if !isHex(s[i : i+1]) {
				return false
			}
		}
		return true
	}
	return false
}

// validContainerID reports whether s looks like a runtime's container ID:
// lowercase hex, 12 to 128 digits (containerd, CRI-O and Docker use 64).
func validContainerID(s string) bool {
	return len(s) >= 12 && len(s) <= 128 && isHex(s)
}

func isHex(s string) bool {
	for i := range len(s) {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// FromProc returns the pod of process pid, read from
// <procRoot>/<pid>/cgroup (procRoot is "/proc" on a host, or where the host's
// procfs is mounted in the agent's container). The cgroup v2 line wins; on a
// cgroup v1 host the first line that names a pod does.
func FromProc(procRoot string, pid int) (Pod, error) {
	name := filepath.Join(procRoot, strconv.Itoa(pid), "cgroup")
	f, err := os.Open(name)
	if err != nil {
		return Pod{}, fmt.Errorf("reading cgroup of pid %d: %w", pid, err)
	}
	defer f.Close()
	pod, err := ParseProcCgroup(f)
	if err != nil {
		return Pod{}, fmt.Errorf("pid %d: %w", pid, err)
	}
	return pod, nil
}

// ParseProcCgroup parses the lines of a /proc/<pid>/cgroup file,
// hierarchy-ID:controllers:path, and returns the pod they name: the cgroup
// v2 line's, else the first cgroup v1 line that names one.
func ParseProcCgroup(r io.Reader) (Pod, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxLineBytes)
	var v1 *Pod
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		pod, err := Parse(parts[2])
		if err != nil {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			return pod, nil
		}
		if v1 == nil {
			v1 = &pod
		}
	}
	if err := sc.Err(); err != nil {
		return Pod{}, fmt.Errorf("reading cgroup lines: %w", err)
	}
	if v1 == nil {
		return Pod{}, ErrNotPod
	}
	return *v1, nil
}
