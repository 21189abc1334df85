package e2e

import (
	"context"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/weightd/weightd/internal/hubtest"
	"github.com/weightd/weightd/internal/testbed"
)

// The peer's model and link, sized so that the transfer, not the pod's
// start, is most of the time to Running.
const (
	peerModel     = "hf://org/peer-model@main"
	peerModelSize = 128 << 20 // the weights; config.json adds a few bytes
	peerLinkMbit  = 300
)

// peerFigures is what csiFromPeer measured.
type peerFigures struct {
	modelBytes int64   // S: every file of the model
	linkMbit   int     // B, in Mbit/s
	sOverB     float64 // S/B, in seconds
	runningS   float64 // the pod's creation to Running
}

// csiFromPeer runs a second agent, as a plain process, in a network
// namespace of its own joined to the node's by a link shaped to
// peerLinkMbit (internal/testbed). It gossips with the node's agent, with
// the chart's gossip key and peer CA read from their Secrets, and holds a
// model whole, fetched from the hub. Then the hub holds back the model's
// weights, and a pod under Pod Security restricted mounts the
// model with the CSI volume: the node's agent resolves the reference on the
// hub, fetches the weights from the peer over the shaped link and mutual
// TLS, and the pod runs. The node's agent counts the weights' bytes as
// received from a peer, none from the origin.
func (c *cluster) csiFromPeer(t *testing.T, ctx context.Context, sleeper string) peerFigures {
	node := c.agentPod(t, ctx)
	require.NotNil(t, node)
	hostIP, err := netip.ParseAddr(node.Status.HostIP)
	require.NoError(t, err, "the agent's pod's host IP")
	// A namespace does not route packets for another's loopback.
	require.False(t, hostIP.IsLoopback(), "the node's IP %s is loopback: no peer namespace reaches it", hostIP)

	tb := testbed.NewT(t, testbed.Config{Hosts: 1, LinkMbit: peerLinkMbit, LinkRoot: true})
	h := tb.Hosts()[0]
	hubLn, err := h.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	c.hub.Serve(hubLn)

	// The weights are stored with LFS, read by ranges, as chunks from a
	// peer or the origin; config.json is stored in git and read whole from
	// the hub while the reference resolves, with the listing.
	weights := newGate(0, hubtest.Generated(peerModelSize, 21))
	defer weights.open()
	config := hubtest.String(`{"model_type":"peer"}`)
	c.hub.AddRepo("org/peer-model", map[string]hubtest.Content{"model.safetensors": weights, "config.json": config})
	size := weights.Size() + config.Size()

	dir := t.TempDir()
	files := map[string][]byte{}
	for _, s := range []struct{ secret, key, file string }{
		{release + "-gossip", "keys", "gossip-keys"},
		{release + "-peer-ca", "ca.crt", "ca.crt"},
		{release + "-peer-ca", "ca.key", "ca.key"},
	} {
		sec, err := c.client.CoreV1().Secrets(namespace).Get(ctx, s.secret, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotEmpty(t, sec.Data[s.key], "secret %s has no %s", s.secret, s.key)
		files[s.file] = sec.Data[s.key]
	}
	for name, b := range files {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), b, 0o600))
	}
	api := "unix://" + filepath.Join(dir, "api.sock")
	peerMetrics := netip.AddrPortFrom(h.Addr, 9464).String()
	c.startPeer(t, h.Command(ctx, c.bin, "agent",
		"--root="+filepath.Join(dir, "cache"),
		"--api="+api,
		"--metrics-addr="+peerMetrics,
		"--node-name=peer",
		"--gossip-addr="+netip.AddrPortFrom(h.Addr, uint16(c.gossipPort)).String(),
		"--chunk-addr="+netip.AddrPortFrom(h.Addr, uint16(c.chunkPort)).String(),
		"--join="+net.JoinHostPort(hostIP.String(), strconv.Itoa(c.gossipPort)),
		"--gossip-key-file="+filepath.Join(dir, "gossip-keys"),
		"--peer-ca-file="+filepath.Join(dir, "ca.crt"),
		"--peer-ca-key-file="+filepath.Join(dir, "ca.key"),
		"--hf-endpoint=http://"+hubLn.Addr().String(),
	), filepath.Join(dir, "agent.log"))

	// The peer announces what it holds to the members it knows: the node's
	// agent must be one before the fetch ends.
	require.Eventually(t, func() bool { return c.metric(t, "weightd_p2p_peers") >= 1 }, time.Minute, 250*time.Millisecond,
		"the node's agent never counted the peer as a member")
	complete := c.metric(t, `weightd_p2p_gossip_messages_total{kind="complete"}`)
	fetch := exec.CommandContext(ctx, c.bin, "fetch", "--wait", "--timeout=3m", "--api="+api, peerModel)
	out, err := fetch.CombinedOutput()
	require.NoError(t, err, "the peer's fetch:\n%s", out)
	require.Eventually(t, func() bool { return c.metric(t, `weightd_p2p_gossip_messages_total{kind="complete"}`) >= complete+2 }, time.Minute, 250*time.Millisecond,
		"the node's agent never heard that the peer holds the model's two files")

	// From here the hub resolves the model but sends none of its weights.
	weights.arm()
	fromPeer := c.metric(t, `weightd_p2p_received_bytes_total{source="peer"}`)
	fromOrigin := c.metric(t, `weightd_p2p_received_bytes_total{source="origin"}`)
	served := metricAt(t, peerMetrics, "weightd_p2p_served_bytes_total")
	hubBytes := c.hub.Stats().Bytes

	image := c.push(t, ctx, "sleeper", "v1", mustImage(t, sleeper, "/sleeper"))
	start := time.Now()
	yes := true
	c.createRestrictedWith(t, ctx, "from-peer", image, corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
		Driver: "models.weightd.io", ReadOnly: &yes, VolumeAttributes: map[string]string{"model": peerModel},
	}})
	// When the node's agent has the weights, to within a poll (250 ms):
	// the rest of the time is the kubelet's.
	var received float64
	p := c.waitPod(t, ctx, restrictedNS, "from-peer", 3*time.Minute, func(p *corev1.Pod) bool {
		if received == 0 && c.metric(t, `weightd_p2p_received_bytes_total{source="peer"}`)-fromPeer >= float64(weights.Size()) {
			received = time.Since(start).Seconds()
		}
		return p.Status.Phase == corev1.PodRunning
	})
	running := time.Since(start).Seconds()

	fromPeer = c.metric(t, `weightd_p2p_received_bytes_total{source="peer"}`) - fromPeer
	fromOrigin = c.metric(t, `weightd_p2p_received_bytes_total{source="origin"}`) - fromOrigin
	served = metricAt(t, peerMetrics, "weightd_p2p_served_bytes_total") - served
	hubBytes = c.hub.Stats().Bytes - hubBytes
	f := peerFigures{modelBytes: size, linkMbit: peerLinkMbit, sOverB: float64(size*8) / (peerLinkMbit * 1e6), runningS: running}
	t.Logf("a pod with the CSI volume of a model (S = %d bytes) that a peer holds, over a %d Mbit/s link (S/B = %.2f s): Running after %.2f s (%.2f × S/B), "+
		"the weights received after %.2f s (%.0f Mbit/s from the pod's creation); "+
		"the node's agent received %.0f bytes from peers and %.0f from the origin, the peer served %.0f, the hub %d (the weights asked for: %v)",
		size, peerLinkMbit, f.sOverB, running, running/f.sOverB, received, float64(weights.Size()*8)/received/1e6,
		fromPeer, fromOrigin, served, hubBytes, weights.reached())
	require.GreaterOrEqual(t, fromPeer, float64(weights.Size()), "the node's agent did not receive the weights from the peer")
	require.GreaterOrEqual(t, served, float64(weights.Size()), "the peer did not serve the weights")
	require.Zero(t, fromOrigin, "the node's agent received chunks from the origin")
	require.LessOrEqual(t, hubBytes, config.Size(), "the hub sent more than config.json")
	target := c.csiTarget(p)
	require.True(t, isMount(t, target), "the volume's target %s is not a mount", target)
	// A publish that waited its most for the fetch was answered with its
	// progress, and the kubelet retried after a back-off: part of the time.
	events, err := c.client.CoreV1().Events(restrictedNS).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", p.Name).String(),
	})
	require.NoError(t, err)
	for _, e := range events.Items {
		if e.Reason == "FailedMount" {
			t.Logf("publish retried: %s (%d×)", e.Message, e.Count)
		}
	}

	c.deletePodIn(t, ctx, restrictedNS, p.Name)
	require.Eventually(t, func() bool { return !isMount(t, target) && len(c.csiRecords()) == 0 }, time.Minute, 250*time.Millisecond,
		"after the pod's deletion: records %v", c.csiRecords())
	return f
}

// startPeer starts the peer's agent, logging to logPath, and stops it
// (SIGTERM, so that it leaves the gossip) when the test ends; the log's
// end is logged if the test failed.
func (c *cluster) startPeer(t *testing.T, cmd *exec.Cmd, logPath string) {
	logf, err := os.Create(logPath)
	require.NoError(t, err)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			if len(b) > 6000 {
				b = b[len(b)-6000:]
			}
			t.Logf("the peer's agent's log:\n%s", b)
		}
	})
}
