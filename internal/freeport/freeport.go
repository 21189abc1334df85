// Package freeport picks ports for the servers that tests and test beds
// start: ports nothing listens on now, by TCP or UDP, below the kernel's
// ephemeral range. A port the kernel hands out for ":0" comes from that
// range, and between the pick and the server's bind an outgoing
// connection can take it ("address already in use", seen in CI).
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

// lowest is the first port picked: below it lie well-known services.
const lowest = 10000

// given are the ports this process has handed out: a server may not have
// bound one yet.
var given sync.Map

// Ports returns n distinct ports free on host, by TCP and UDP ("" for
// every address), that this process has not handed out before.
func Ports(host string, n int) ([]int, error) {
	top := ephemeralLow()
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		if tries == 1000*n {
			return nil, fmt.Errorf("freeport: no %d free ports on %q below %d", n, host, top)
		}
		port := lowest + rand.IntN(top-lowest)
		if _, taken := given.LoadOrStore(port, true); taken {
			continue
		}
		if free(host, port) {
			ports = append(ports, port)
		}
	}
	return ports, nil
}

// Port is one of Ports.
func Port(host string) (int, error) {
	ports, err := Ports(host, 1)
	if err != nil {
		return 0, err
	}
	return ports[0], nil
}

// free reports whether port can be bound on host by TCP and by UDP now.
func free(host string, port int) bool {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return false
	}
	ln.Close()
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		return false
	}
	pc.Close()
	return true
}

// ephemeralLow is the first port of the kernel's ephemeral range, from
// which it picks the local ports of outgoing connections.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if f := strings.Fields(string(b)); err == nil && len(f) == 2 {
		if low, err := strconv.Atoi(f[0]); err == nil && low > 2*lowest {
			return low
		}
	}
	return 32768
}
