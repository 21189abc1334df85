package p2p

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// acceptedCongestion dials ln and returns the congestion control of the
// connection it accepts.
func acceptedCongestion(t *testing.T, ln net.Listener) string {
	t.Helper()
	client, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer client.Close()
	conn, err := ln.Accept()
	require.NoError(t, err)
	defer conn.Close()
	raw, err := conn.(*net.TCPConn).SyscallConn()
	require.NoError(t, err)
	var cc string
	var ccErr error
	require.NoError(t, raw.Control(func(fd uintptr) {
		cc, ccErr = unix.GetsockoptString(int(fd), unix.IPPROTO_TCP, unix.TCP_CONGESTION)
	}))
	require.NoError(t, ccErr)
	return cc
}

func TestListenChunksSetsUploadCongestion(t *testing.T) {
	// reno is always built in and always allowed.
	ln, err := ListenChunks(context.Background(), "127.0.0.1:0", "reno", nil)
	require.NoError(t, err)
	defer ln.Close()
	require.Equal(t, "reno", acceptedCongestion(t, ln), "accepted uploads inherit the listener's algorithm")
}

func TestListenChunksKeepsTheDefaultWhenTheAlgorithmIsMissing(t *testing.T) {
	var logs bytes.Buffer
	ln, err := ListenChunks(context.Background(), "127.0.0.1:0", "no-such-algorithm", slog.New(slog.NewTextHandler(&logs, nil)))
	require.NoError(t, err, "sharing works without the algorithm")
	defer ln.Close()
	require.Contains(t, logs.String(), "no-such-algorithm")

	plain, err := ListenChunks(context.Background(), "127.0.0.1:0", "", nil)
	require.NoError(t, err)
	defer plain.Close()
	require.Equal(t, acceptedCongestion(t, plain), acceptedCongestion(t, ln), "the node's default")
}
