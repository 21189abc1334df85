package kubenode_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/weightd/weightd/internal/kubenode"
	"github.com/weightd/weightd/internal/kubetest"
)

// require skips without what a node needs, except under CI=true.
func requireNode(t *testing.T) {
	t.Helper()
	kubetest.Require(t)
	if err := kubenode.Available(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
}

// TestPodRuns starts a node and runs a pod on it: the kubelet registers
// the node, the scheduler binds the pod, the CRI starts its sandbox and
// container on runc with a bridge address, and the container's exit code
// reaches the pod's status.
func TestPodRuns(t *testing.T) {
	requireNode(t)
	env := kubetest.NewT(t, kubetest.Config{ControlPlane: true})
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	node, err := kubenode.Start(ctx, env, kubenode.Config{Name: "kn-test", Dir: t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, node.Close()) })

	bin, err := kubenode.BuildStatic(ctx, filepath.Join(t.TempDir(), "build"), "exit3", "package main\n\nimport \"os\"\n\nfunc main() { os.Exit(3) }\n")
	require.NoError(t, err)
	img, err := kubenode.ProgramImage(bin, "/exit3")
	require.NoError(t, err)
	require.NoError(t, node.ImportImage(ctx, "kubenode.test/exit3:1", img))

	pods := env.Clientset().CoreV1().Pods(metav1.NamespaceDefault)
	_, err = pods.Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "exit3"},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers:    []corev1.Container{{Name: "c", Image: "kubenode.test/exit3:1", ImagePullPolicy: corev1.PullNever}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	var pod *corev1.Pod
	for deadline := time.Now().Add(2 * time.Minute); pod == nil || pod.Status.Phase != corev1.PodFailed; time.Sleep(250 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the pod never ended: %+v\n%s", pod.Status, node.LogTail())
		}
		pod, err = pods.Get(ctx, "exit3", metav1.GetOptions{})
		require.NoError(t, err)
	}
	require.Equal(t, "kn-test", pod.Spec.NodeName)
	require.NotEmpty(t, pod.Status.PodIP)
	require.Len(t, pod.Status.ContainerStatuses, 1)
	require.Equal(t, int32(3), pod.Status.ContainerStatuses[0].State.Terminated.ExitCode)
}

// TestBidirectionalKubeletDir: a privileged pod that mounts the node's
// KubeletDir with Bidirectional propagation, as a CSI node plugin's
// DaemonSet does, is started by the runtime (which refuses it on a private
// mount), and a mount it makes under plugins/ is seen by the host, where
// the kubelet would bind it into another pod.
func TestBidirectionalKubeletDir(t *testing.T) {
	requireNode(t)
	env := kubetest.NewT(t, kubetest.Config{ControlPlane: true})
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	node, err := kubenode.Start(ctx, env, kubenode.Config{Name: "kn-bidi", Dir: t.TempDir()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, node.Close()) })

	bin, err := kubenode.BuildStatic(ctx, filepath.Join(t.TempDir(), "build"), "mounter", `package main

import (
	"os"
	"syscall"
	"time"
)

func main() {
	dir := os.Args[1]
	if err := os.MkdirAll(dir, 0o755); err != nil {
		panic(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		panic(err)
	}
	if err := os.WriteFile(dir+"/seen", []byte("mounted in the pod"), 0o644); err != nil {
		panic(err)
	}
	time.Sleep(time.Hour)
}
`)
	require.NoError(t, err)
	img, err := kubenode.ProgramImage(bin, "/mounter")
	require.NoError(t, err)
	require.NoError(t, node.ImportImage(ctx, "kubenode.test/mounter:1", img))

	target := filepath.Join(node.KubeletDir, "plugins", "kubenode.test", "mnt")
	privileged, bidirectional := true, corev1.MountPropagationBidirectional
	_, err = env.Clientset().CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "mounter"},
		Spec: corev1.PodSpec{
			NodeName: node.Name,
			Containers: []corev1.Container{{
				Name: "c", Image: "kubenode.test/mounter:1", ImagePullPolicy: corev1.PullNever,
				Args:            []string{target},
				SecurityContext: &corev1.SecurityContext{Privileged: &privileged},
				VolumeMounts:    []corev1.VolumeMount{{Name: "kubelet", MountPath: node.KubeletDir, MountPropagation: &bidirectional}},
			}},
			Volumes: []corev1.Volume{{Name: "kubelet", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: node.KubeletDir}}}},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	var got []byte
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(250 * time.Millisecond) {
		if got, err = os.ReadFile(filepath.Join(target, "seen")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			pod, _ := env.Clientset().CoreV1().Pods(metav1.NamespaceDefault).Get(ctx, "mounter", metav1.GetOptions{})
			t.Fatalf("the pod's mount never reached the host: %v\npod status %+v\n%s", err, pod.Status, node.LogTail())
		}
	}
	require.Equal(t, "mounted in the pod", string(got))
}
