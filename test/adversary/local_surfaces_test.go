package adversary

// Attack 11, services meant for the node alone: the agent served Go's
// profiles (memory, stacks, and CPU profiles that cost CPU) on the metrics
// address, which the chart opens on every address of the node for
// Prometheus; and it served its unauthenticated API on any tcp:// address
// it was given, all interfaces included.

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/api"
)

func TestPprofOnMetricsAddress(t *testing.T) {
	t.Parallel()
	metrics, prof := freeAddr(t), freeAddr(t)
	// WEIGHTD_PPROF turned profiles on before they had an address of their own.
	a := startAgentProc(t, nil, []string{"WEIGHTD_PPROF=true", "WEIGHTD_PPROF_ADDR=" + prof}, "--metrics-addr", metrics)
	a.waitReady(t)
	require.Equal(t, http.StatusOK, getStatus(t, "http://"+metrics+"/metrics"))
	require.Equal(t, http.StatusNotFound, getStatus(t, "http://"+metrics+"/debug/pprof/"),
		"the metrics listener, which Prometheus reaches from the network, serves Go's profiles")
	require.Equal(t, http.StatusOK, getStatus(t, "http://"+prof+"/debug/pprof/"), "profiles on their own loopback address")

	_, port, err := net.SplitHostPort(freeAddr(t))
	require.NoError(t, err)
	b := startAgentProc(t, nil, []string{"WEIGHTD_PPROF_ADDR=0.0.0.0:" + port})
	require.True(t, hasLine(b.exitLog(t), "--pprof-addr", "not a loopback address"), "log:\n%s", b.logs.String())
}

func TestAPIOnAllInterfaces(t *testing.T) {
	t.Parallel()
	_, port, err := net.SplitHostPort(freeAddr(t))
	require.NoError(t, err)
	a := startAgentProc(t, nil, nil, "--api", "tcp://0.0.0.0:"+port)
	client, err := api.NewClient("tcp://127.0.0.1:" + port)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for {
		select {
		case <-a.exited:
			require.True(t, hasLine(a.logs.String(), "--api", "not a loopback address", "--api-allow-remote"), "log:\n%s", a.logs.String())
			// The operator may still ask for it, in so many words.
			b := startAgentProc(t, nil, []string{"WEIGHTD_API_ALLOW_REMOTE=true"}, "--api", "tcp://0.0.0.0:"+port)
			require.NoError(t, client.WaitReady(ctx), "log:\n%s", b.logs.String())
			return
		case <-ctx.Done():
			t.Fatalf("the agent neither served nor refused tcp://0.0.0.0:%s; log:\n%s", port, a.logs.String())
		case <-time.After(50 * time.Millisecond):
			require.Error(t, client.Ready(ctx), "the agent serves its unauthenticated API on every interface (tcp://0.0.0.0:%s)", port)
		}
	}
}

// getStatus GETs url and returns the status code.
func getStatus(t *testing.T, url string) int {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}
