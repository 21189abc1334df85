package gossipnet

import (
	"io"
	"testing"

	"github.com/hashicorp/memberlist"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A packet is sent without the receiver reading it (MockTransport alone
// would block here for ever), arrives as it was sent even if the sender
// reuses its buffer, and is counted; a stream's bytes are counted both ways.
func TestSendsWithoutWaitingAndCounts(t *testing.T) {
	t.Parallel()
	var n Network
	a, b := n.NewTransport("a"), n.NewTransport("b")
	ip, port, err := b.FinalAdvertiseAddr("", 0)
	require.NoError(t, err)
	to := memberlist.Address{Addr: (&memberlist.Node{Addr: ip, Port: uint16(port)}).Address(), Name: "b"}

	buf := []byte("ping")
	_, err = a.WriteToAddress(buf, to)
	require.NoError(t, err)
	_, err = a.WriteTo([]byte("second"), to.Addr)
	require.NoError(t, err)
	copy(buf, "XXXX")
	got := map[string]bool{}
	for range 2 {
		got[string((<-b.PacketCh()).Buf)] = true
	}
	assert.Equal(t, map[string]bool{"ping": true, "second": true}, got)
	assert.Equal(t, Sent{PacketBytes: 10, Packets: 2}, n.Sent())

	accepted := make(chan error, 1)
	go func() { // the mock hands the stream over only when it is accepted
		peer := <-b.StreamCh()
		ask := make([]byte, 3)
		_, err := io.ReadFull(peer, ask)
		if err == nil {
			_, err = peer.Write([]byte("answer"))
		}
		accepted <- err
		_ = peer.Close()
	}()
	c, err := a.DialAddressTimeout(to, 0)
	require.NoError(t, err)
	_, err = c.Write([]byte("ask"))
	require.NoError(t, err)
	answer, err := io.ReadAll(c)
	require.NoError(t, err)
	require.NoError(t, <-accepted)
	assert.Equal(t, "answer", string(answer))
	assert.Equal(t, Sent{PacketBytes: 10, Packets: 2, StreamBytes: 9, Streams: 1}, n.Sent())
}
