// Package gossipnet is an in-process network for memberlist: it wraps
// memberlist.MockNetwork so that a packet is sent as UDP sends one, without
// waiting for the receiver, and counts what the members send. MockTransport
// alone hands a packet over only when the receiver reads it, so two members
// whose packet handlers answer each other at once wait on each other for
// ever.
package gossipnet

import (
	"bytes"
	"net"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// Network makes the transports of the members of one in-process cluster.
// NewTransport is not safe for concurrent use and must not be called once
// a transport is in use (MockNetwork's maps are not locked); everything
// else is.
type Network struct {
	mock                                       memberlist.MockNetwork
	packetBytes, packets, streamBytes, streams atomic.Int64
}

// NewTransport returns the transport of the member called name, at a new
// address.
func (n *Network) NewTransport(name string) *Transport {
	return &Transport{MockTransport: n.mock.NewTransport(name), net: n}
}

// Sent is what the transports of a Network have sent, as memberlist hands
// it over: compressed and encrypted, without UDP, TCP and IP headers.
type Sent struct {
	PacketBytes, Packets int64
	StreamBytes          int64 // both directions of every stream
	Streams              int64 // push/pulls, joins, probes by TCP
}

// Sent returns what all transports have sent so far.
func (n *Network) Sent() Sent {
	return Sent{PacketBytes: n.packetBytes.Load(), Packets: n.packets.Load(), StreamBytes: n.streamBytes.Load(), Streams: n.streams.Load()}
}

// Transport is a member's memberlist.NodeAwareTransport on a Network.
type Transport struct {
	*memberlist.MockTransport
	net *Network
}

var _ memberlist.NodeAwareTransport = (*Transport)(nil)

// WriteTo sends a packet to addr without waiting for the receiver.
func (t *Transport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress sends a packet to a without waiting for the receiver. A
// packet to a member that has shut down is never delivered, as with UDP.
func (t *Transport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	t.net.packetBytes.Add(int64(len(b)))
	t.net.packets.Add(1)
	b = bytes.Clone(b) // memberlist may reuse b once this returns
	go func() { _, _ = t.MockTransport.WriteToAddress(b, a) }()
	return time.Now(), nil
}

// DialTimeout opens a stream to addr.
func (t *Transport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout opens a stream to a; both of its directions are
// counted here, as every stream has one end opened by a member.
func (t *Transport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	c, err := t.MockTransport.DialAddressTimeout(a, timeout)
	if err != nil {
		return nil, err
	}
	t.net.streams.Add(1)
	return &conn{Conn: c, n: t.net}, nil
}

type conn struct {
	net.Conn
	n *Network
}

func (c *conn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.n.streamBytes.Add(int64(n))
	return n, err
}

func (c *conn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.n.streamBytes.Add(int64(n))
	return n, err
}
