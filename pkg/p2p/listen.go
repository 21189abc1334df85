package p2p

import (
	"context"
	"log/slog"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// ListenChunks opens the chunk server's TCP listener on addr. The uploads it
// accepts use the TCP congestion control named congestion (accepted
// connections inherit the listener's), or the node's default when it is
// empty. A kernel that lacks that algorithm, or does not let this process
// choose it, leaves the default, with a warning: sharing still works.
//
// The agent asks for CUBIC. A swarm runs many uploads from every node into
// every other at once, through switch ports with shallow buffers. BBRv1,
// the default on many nodes, ignores loss and keeps about two
// bandwidth-delay products in flight per flow, so such flows drop packets
// at a high rate (on the namespace testbed, 7–9% of an uplink's packets,
// and the swarm took 3–4% longer); CUBIC backs off on loss and shares the
// ports evenly.
func ListenChunks(ctx context.Context, addr, congestion string, log *slog.Logger) (net.Listener, error) {
	var ccErr error
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		if congestion == "" {
			return nil
		}
		return c.Control(func(fd uintptr) {
			ccErr = unix.SetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION, congestion)
		})
	}}
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if ccErr != nil && log != nil {
		log.Warn("uploading with the node's default TCP congestion control", "wanted", congestion, "err", ccErr)
	}
	return ln, nil
}
