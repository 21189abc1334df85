package adversary

// Attack 10, fetching arbitrary URLs from the host network: the agent runs
// on the node's network, and any pod names the URLs it fetches. A reference
// to http://169.254.169.254/… made it ask the cloud metadata service for the
// node's credentials; one to an allowed origin that redirects to loopback
// made it call the node's own services (the kubelet, containerd, weightd's
// API). Each witness is a server counting connections: it must get none.

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/pkg/prefetch"
)

// metadataAddr is the cloud metadata service's address on AWS, GCP, Azure
// and others.
const metadataAddr = "169.254.169.254"

// TestFetchMetadataAddress runs the agent on a testbed host ("the node")
// and the metadata service on another at 169.254.169.254, routed as a cloud
// routes it; a reference to it must make no request there.
func TestFetchMetadataAddress(t *testing.T) {
	t.Parallel()
	tb := testbed.NewT(t, testbed.Config{Hosts: 2})
	node, imds := tb.Hosts()[0], tb.Hosts()[1]
	ip := func(h *testbed.Host, args ...string) {
		out, err := h.Command(t.Context(), "ip", args...).CombinedOutput()
		require.NoError(t, err, "ip %s: %s", strings.Join(args, " "), out)
	}
	ip(imds, "addr", "add", metadataAddr+"/32", "dev", "eth0")
	ip(node, "route", "add", metadataAddr+"/32", "dev", "eth0")

	var hits atomic.Int64
	for _, port := range []string{"80", "443"} { // http://, and https:// for registries
		ln, err := imds.Listen("tcp", net.JoinHostPort(metadataAddr, port))
		require.NoError(t, err)
		serveCounting(t, ln, &hits, "AKIAEXAMPLE:secret")
	}

	a := startAgentProc(t, node, nil)
	a.waitReady(t)
	for _, ref := range []string{
		"http://" + metadataAddr + "/latest/meta-data/iam/security-credentials/node-role",
		"http://" + metadataAddr + "/latest/meta-data/iam/security-credentials/node-role#sha256:" + strings.Repeat("ab", 32),
		"oci://" + metadataAddr + "/latest/meta-data:v1",
	} {
		st := a.fetch(t, ref)
		require.Equal(t, prefetch.StateFailed, st.State, "%s: %+v", ref, st)
		require.Zero(t, hits.Load(), "the metadata service got connections from the agent for %s; job: %+v", ref, st)
		require.Contains(t, st.Error, "address refused", ref)
	}
}

// TestFetchRedirectToLoopback: an origin the operator allows (127.0.0.2,
// through the allowlist) redirects to a service on 127.0.0.1, which is not
// allowed; the agent must not follow it.
func TestFetchRedirectToLoopback(t *testing.T) {
	t.Parallel()
	local, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var hits atomic.Int64
	serveCounting(t, local, &hits, `{"kubelet":"secrets"}`)

	ln, err := net.Listen("tcp", "127.0.0.2:0")
	require.NoError(t, err)
	target := "http://" + local.Addr().String() + "/model.json"
	srv := &http.Server{Handler: http.RedirectHandler(target, http.StatusFound)}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	a := startAgentProc(t, nil, []string{"WEIGHTD_FETCH_ALLOW_CIDRS=127.0.0.2/32"})
	a.waitReady(t)
	ref := "http://" + ln.Addr().String() + "/model.json"
	st := a.fetch(t, ref)
	require.Equal(t, prefetch.StateFailed, st.State, "%+v", st)
	require.Zero(t, hits.Load(), "the loopback service got connections from the agent after a redirect; job: %+v", st)
	require.Contains(t, st.Error, "address refused")
}

// serveCounting serves body on ln, counting accepted connections in n (a
// TLS handshake counts too: reaching the address is the harm).
func serveCounting(t *testing.T, ln net.Listener, n *atomic.Int64, body string) {
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, body) }),
		ConnState: func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				n.Add(1)
			}
		},
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
}
