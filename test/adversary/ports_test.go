package adversary

import (
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/freeport"
)

// freeAddr is a loopback address whose port nothing listens on now, on
// any address (an agent may be told to bind them all), and that no
// outgoing connection takes before the agent binds it (freeport).
func freeAddr(t *testing.T) string {
	t.Helper()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
}

// freePort is freeAddr's port.
func freePort(t *testing.T) int {
	t.Helper()
	port, err := freeport.Port("")
	require.NoError(t, err)
	return port
}
