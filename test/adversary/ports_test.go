package adversary

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// givenPorts are the ports freeAddr has handed out in this process.
var givenPorts sync.Map

// freeAddr is a loopback address whose port nothing listens on now, by TCP
// or UDP on any address, below the kernel's ephemeral range: a port from
// that range, free when asked for, was taken by some test's outgoing
// connection before the agent bound it ("address already in use", in CI).
func freeAddr(t *testing.T) string {
	t.Helper()
	const lowest = 10000
	top := ephemeralLow()
	for range 1000 {
		port := strconv.Itoa(lowest + rand.IntN(top-lowest))
		if _, taken := givenPorts.LoadOrStore(port, true); taken {
			continue
		}
		ln, err := net.Listen("tcp", ":"+port)
		if err != nil {
			continue
		}
		ln.Close()
		pc, err := net.ListenPacket("udp", ":"+port)
		if err != nil {
			continue
		}
		pc.Close()
		return net.JoinHostPort("127.0.0.1", port)
	}
	require.FailNow(t, "no free port below the ephemeral range")
	return ""
}

// freePort is freeAddr's port.
func freePort(t *testing.T) int {
	t.Helper()
	_, port, err := net.SplitHostPort(freeAddr(t))
	require.NoError(t, err)
	n, err := strconv.Atoi(port)
	require.NoError(t, err)
	return n
}

// ephemeralLow is the first port of the kernel's ephemeral range, from
// which it picks the local ports of outgoing connections.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if f := strings.Fields(string(b)); err == nil && len(f) == 2 {
		if low, err := strconv.Atoi(f[0]); err == nil && low > 20000 {
			return low
		}
	}
	return 32768
}
