package freeport

import (
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// Ports are distinct, below the ephemeral range, never handed out twice,
// and bindable; one a server holds is not handed out.
func TestPortsAreFreeAndDistinct(t *testing.T) {
	t.Parallel()
	ports, err := Ports("127.0.0.1", 50)
	require.NoError(t, err)
	seen := map[int]bool{}
	for _, p := range ports {
		require.False(t, seen[p], "port %d twice", p)
		seen[p] = true
		require.GreaterOrEqual(t, p, lowest)
		require.Less(t, p, ephemeralLow())
	}
	more, err := Ports("", 50)
	require.NoError(t, err)
	for _, p := range more {
		require.False(t, seen[p], "port %d handed out again", p)
	}

	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0])))
	require.NoError(t, err, "a port handed out binds")
	defer ln.Close()
	require.False(t, free("127.0.0.1", ports[0]), "a bound port is not free")
	require.False(t, free("", ports[0]), "nor on every address")
}
