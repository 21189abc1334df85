package p2p

import (
	"bytes"

	"github.com/hashicorp/memberlist"
)

// membershipDelegate is the memberlist.Delegate of a Membership. memberlist
// calls it from its packet and stream goroutines, concurrently; no method
// blocks, and none keeps a buffer it was handed.
type membershipDelegate Membership

// NodeMeta returns the encoded NodeMeta, which always fits memberlist's
// limit; it returns nothing rather than something over limit.
func (d *membershipDelegate) NodeMeta(limit int) []byte {
	d.mu.Lock()
	meta := bytes.Clone(d.meta)
	d.mu.Unlock()
	if len(meta) > limit {
		d.log.Error("node meta over memberlist's limit, sending none", "size", len(meta), "limit", limit)
		return nil
	}
	return meta
}

// NotifyMsg takes in an event another node gossiped. News is applied to the
// Router and relayed, so that it spreads to every member even when the
// announcing node's own retransmissions miss some. An event about a node
// that is no member is dropped, so that claims for made-up nodes neither
// fill the Router nor spread; one that arrives before its node's join is
// made good by that node's push/pull state.
func (d *membershipDelegate) NotifyMsg(b []byte) {
	m := (*Membership)(d)
	ev, err := decodeEvent(b) // copies what it keeps of b
	if err != nil {
		m.metrics.dropped.Inc()
		m.log.Debug("dropping gossip message", "err", err)
		return
	}
	m.metrics.messages.WithLabelValues(ev.Kind.String()).Inc()
	if ev.Node == m.cfg.NodeName {
		return
	}
	if !m.isPeer(ev.Node) {
		m.metrics.dropped.Inc()
		m.log.Debug("dropping an event about a node that is no member", "node", ev.Node)
		return
	}
	if !m.router.apply(ev) {
		return
	}
	msg, err := encodeEvent(ev)
	if err != nil { // cannot happen: ev was just decoded
		m.log.Error("re-encoding a gossip event", "err", err)
		return
	}
	m.queueBroadcast(ev, msg)
}

// GetBroadcasts hands memberlist the queued events that fit its packet.
func (d *membershipDelegate) GetBroadcasts(overhead, limit int) [][]byte {
	return d.broadcasts.GetBroadcasts(overhead, limit)
}

// LocalState returns this node's own holdings for a push/pull, newest first,
// at most maxStateSize bytes.
func (d *membershipDelegate) LocalState(bool) []byte {
	b, err := d.router.localState(d.cfg.NodeName)
	if err != nil { // cannot happen: the name was validated and so were the holdings
		d.log.Error("encoding the push/pull state", "err", err)
		return nil
	}
	return b
}

// MergeRemoteState takes in a peer's holdings from a push/pull; a state of a
// node that is no member is dropped.
func (d *membershipDelegate) MergeRemoteState(b []byte, _ bool) {
	m := (*Membership)(d)
	if len(b) == 0 {
		return
	}
	st, err := decodeState(b) // copies what it keeps of b
	if err != nil {
		m.metrics.dropped.Inc()
		m.log.Debug("dropping push/pull state", "err", err)
		return
	}
	m.metrics.messages.WithLabelValues("state").Inc()
	switch {
	case st.Node == m.cfg.NodeName:
	case !m.isPeer(st.Node):
		m.metrics.dropped.Inc()
		m.log.Debug("dropping the push/pull state of a node that is no member", "node", st.Node)
	default:
		m.router.merge(st)
	}
}

// membershipEvents is the memberlist.EventDelegate of a Membership. memberlist
// calls it one event at a time; it keeps the peer list and tells the Router
// who left.
type membershipEvents Membership

// NotifyJoin records a new live peer.
func (e *membershipEvents) NotifyJoin(n *memberlist.Node) {
	m := (*Membership)(e)
	if n.Name == m.cfg.NodeName {
		return
	}
	m.router.joined(n.Name)
	m.setPeer(n)
	m.log.Info("peer joined", "peer", n.Name, "addr", n.Address())
}

// NotifyUpdate records a peer's new metadata or address.
func (e *membershipEvents) NotifyUpdate(n *memberlist.Node) {
	m := (*Membership)(e)
	if n.Name == m.cfg.NodeName {
		return
	}
	m.setPeer(n)
}

// NotifyLeave drops a peer that left or was found dead, and has the Router
// forget its holdings at once.
func (e *membershipEvents) NotifyLeave(n *memberlist.Node) {
	m := (*Membership)(e)
	if n.Name == m.cfg.NodeName {
		return
	}
	m.mu.Lock()
	delete(m.peers, n.Name)
	count := len(m.peers)
	m.mu.Unlock()
	m.metrics.peers.Set(float64(count))
	m.router.Forget(n.Name)
	m.log.Info("peer left", "peer", n.Name, "addr", n.Address())
}

// isPeer says whether name is a live peer.
func (m *Membership) isPeer(name string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.peers[name]
	return ok
}

func (m *Membership) setPeer(n *memberlist.Node) {
	meta, err := decodeMeta(n.Meta) // copies what it keeps of n.Meta
	if err != nil {
		m.log.Warn("peer metadata unreadable, using none", "peer", n.Name, "err", err)
	}
	p := Peer{Name: n.Name, GossipAddr: n.Address(), Meta: meta}
	m.mu.Lock()
	m.peers[n.Name] = p
	count := len(m.peers)
	m.mu.Unlock()
	m.metrics.peers.Set(float64(count))
}

// membershipBroadcast is one encoded event in the broadcast queue. Its name
// is the node and blob it is about, so a newer event about them replaces it.
type membershipBroadcast struct {
	name string
	msg  []byte
}

// Name implements memberlist.NamedBroadcast.
func (b *membershipBroadcast) Name() string { return b.name }

// Invalidates reports whether other is about the same node and blob.
func (b *membershipBroadcast) Invalidates(other memberlist.Broadcast) bool {
	o, ok := other.(*membershipBroadcast)
	return ok && o.name == b.name
}

// Message returns the encoded event.
func (b *membershipBroadcast) Message() []byte { return b.msg }

// Finished implements memberlist.Broadcast; nothing waits on events.
func (b *membershipBroadcast) Finished() {}
