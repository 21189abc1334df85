package adversary

// Attack 11, a token over plain HTTP: an http:// hub endpoint got the hub
// token on every request, readable by anyone on the path, and nothing said
// so. The agent still sends it (in-cluster hubs behind plain HTTP are
// common, and the operator chose the endpoint) but warns, naming the host
// and never the token.

import (
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/testbed"
	"github.com/weightd/weightd/pkg/prefetch"
)

func TestTokenOverPlainHTTP(t *testing.T) {
	t.Parallel()
	const token = "hf_plaintextSECRET"
	tb := testbed.NewT(t, testbed.Config{Hosts: 2})
	node, hub := tb.Hosts()[0], tb.Hosts()[1]
	ln, err := hub.Listen("tcp", net.JoinHostPort(hub.Addr.String(), "8080"))
	require.NoError(t, err)
	var withToken atomic.Int64
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") == "Bearer "+token {
			withToken.Add(1)
		}
		http.NotFound(w, r)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	endpoint := "http://" + ln.Addr().String()
	a := startAgentProc(t, node, []string{"HF_TOKEN=" + token, "HF_ENDPOINT=" + endpoint})
	a.waitReady(t)
	st := a.fetch(t, "hf://org/model@main")
	require.Equal(t, prefetch.StateFailed, st.State, "%+v", st)
	require.Positive(t, withToken.Load(), "the hub got no request with the token")
	log := a.logs.String()
	require.True(t, hasLine(log, "level=WARN", "plain HTTP", ln.Addr().String()),
		"the hub token went over plain HTTP to %s and the agent said nothing; log:\n%s", endpoint, log)
	require.False(t, strings.Contains(log, token), "the log holds the token")
}
