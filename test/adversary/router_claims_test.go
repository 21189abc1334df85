package adversary

// Attack 11, the router's claims: a member of the gossip floods an agent
// with holding claims, for nodes that are no members and for more blobs
// than any node holds. The agent is a real Membership and Router on
// loopback; the attacker is a memberlist node of its own speaking the wire
// format pkg/p2p documents (message.go).

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"log"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/p2p"
)

// Bounds the agent is held to: a member's claims kept per member (a node
// that holds more blobs is still found for most of them through push/pull
// and its newest events), and none kept for a node that is no member.
const (
	claimsPerMember = 8192
	floodClaims     = claimsPerMember + 1000
	ghostNodes      = 500
	ghostStateHolds = 1000
)

// floodBlob is the digest of the i-th blob a flood claims under tag.
func floodBlob(tag string, i int) digest.Digest {
	return digest.FromString(tag + strconv.Itoa(i))
}

// holdingEvent encodes a gossip event: node holds d completely.
func holdingEvent(node string, seq uint64, d digest.Digest) []byte {
	b := []byte{1, byte(len(node))}
	b = append(b, node...)
	return holding(b, seq, d)
}

// holding appends a holding: kind complete, seq, raw sha256.
func holding(b []byte, seq uint64, d digest.Digest) []byte {
	raw, _ := hex.DecodeString(d.Encoded())
	b = append(b, 1)
	b = binary.BigEndian.AppendUint64(b, seq)
	return append(b, raw...)
}

// ghostState is a push/pull state of a node that is no member.
type ghostState struct{}

func (ghostState) NodeMeta(int) []byte             { return nil }
func (ghostState) NotifyMsg([]byte)                {}
func (ghostState) GetBroadcasts(int, int) [][]byte { return nil }
func (ghostState) MergeRemoteState([]byte, bool)   {}
func (ghostState) LocalState(bool) []byte          { return ghostStateBytes() }
func ghostStateBytes() []byte {
	const node = "ghost-state"
	b := []byte{1, 0}
	b = binary.BigEndian.AppendUint64(b, uint64(time.Now().UnixNano()))
	b = append(b, byte(len(node)))
	b = append(b, node...)
	for i := range ghostStateHolds {
		b = holding(b, uint64(i+1), floodBlob("ghost-state", i))
	}
	return b
}

// TestRouterClaimsForUnknownMembers: a member sends an agent claims for
// ghostNodes nodes that are no members, a push/pull state of another, and
// floodClaims claims of its own. The agent keeps none of the ghosts' and at
// most claimsPerMember of the member's.
func TestRouterClaimsForUnknownMembers(t *testing.T) {
	reg := prometheus.NewRegistry()
	router := p2p.NewRouter(0)
	agent, err := p2p.NewMembership(p2p.MembershipConfig{NodeName: "agent", BindAddr: "127.0.0.1", BindPort: freePort(t), Fast: true, Registerer: reg}, router)
	require.NoError(t, err)
	ctx := t.Context()
	done := make(chan error, 1)
	go func() { done <- agent.Run(ctx) }()
	t.Cleanup(func() { <-done })
	select {
	case <-agent.Ready():
	case <-time.After(30 * time.Second):
		t.Fatal("the agent's gossip never came up")
	}

	cfg := memberlist.DefaultLANConfig()
	cfg.Name, cfg.BindAddr, cfg.BindPort, cfg.AdvertisePort = "attacker", "127.0.0.1", 0, 0
	cfg.Delegate = ghostState{}
	cfg.Logger = log.New(io.Discard, "", 0)
	attacker, err := memberlist.Create(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { attacker.Shutdown() })
	_, err = attacker.Join([]string{agent.LocalAddr()})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(agent.Members()) == 1 }, 30*time.Second, 20*time.Millisecond)
	var target *memberlist.Node
	for _, n := range attacker.Members() {
		if n.Name == "agent" {
			target = n
		}
	}
	require.NotNil(t, target)

	seq := uint64(time.Now().UnixNano())
	sent := 0
	send := func(msg []byte) {
		require.NoError(t, attacker.SendReliable(target, msg))
		sent++
	}
	for i := range ghostNodes {
		send(holdingEvent(fmt.Sprintf("ghost-%d", i), seq, floodBlob("ghost", i)))
	}
	for i := range floodClaims {
		send(holdingEvent("attacker", seq+uint64(i), floodBlob("attacker", i)))
	}
	// Every event reached the agent's gossip delegate before it is judged.
	require.Eventually(t, func() bool { return gossipEvents(t, reg) >= float64(sent) }, 2*time.Minute, 50*time.Millisecond,
		"the agent received %v of %d events", gossipEvents(t, reg), sent)

	ghosts := 0
	for i := range ghostNodes {
		ghosts += len(router.Holders(floodBlob("ghost", i)))
	}
	for i := range ghostStateHolds {
		ghosts += len(router.Holders(floodBlob("ghost-state", i)))
	}
	claims := 0
	for i := range floodClaims {
		claims += len(router.Holders(floodBlob("attacker", i)))
	}
	t.Logf("claims kept: %d for nodes that are no members, %d of the member's %d", ghosts, claims, floodClaims)
	if ghosts != 0 {
		t.Errorf("%d claims kept for nodes that are no members", ghosts)
	}
	if claims > claimsPerMember {
		t.Errorf("%d claims kept for one member, more than %d", claims, claimsPerMember)
	}
	require.Positive(t, claims, "the member's own claims are kept up to the bound")
}

// gossipEvents is how many holding events the agent received.
func gossipEvents(t *testing.T, reg *prometheus.Registry) float64 {
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "weightd_p2p_gossip_messages_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "kind" && lp.GetValue() != "state" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}
