package swarmsim

import (
	"math"
	"time"
)

// The gossip model, fitted to real memberlist among 30 and 100 members in
// process, production timings (docs/gossip-scale.md):
//
//	go run ./bench/gossip -nodes 30,100,300 -idle 90s  # delays, event bytes (300 did not converge)
//	go run ./bench/gossip -nodes 100,30 -idle 120s     # bytes of a push/pull
//
// It holds while the events fit memberlist's packets (GossipNodes ×
// UDPBufferSize every GossipInterval); past about 1,000 members a
// cluster-wide fill's events do not, and gossip is slower than this.

// delayShape is the inverse distribution of the delays from an event until
// a member's Router lists it, over their median: at quantiles 0, 0.1, …,
// 0.9, then 0.99 and 1 (the 100-member run's p99 and 1.25 times it).
var delayShape = [...]float64{0, 0.528, 0.693, 0.812, 0.914, 1, 1.087, 1.189, 1.334, 1.505, 1.955, 2.444}

// gossipDelay is how long after an event one member learns of it, for u
// uniform in [0, 1): the median grows with ln N, the shape stays.
func gossipDelay(nodes int, u float64) time.Duration {
	median := max(100, -68.3+91.3*math.Log(float64(nodes))) // ms
	q := []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1}
	i := 1
	for i < len(q)-1 && u >= q[i] {
		i++
	}
	f := (u - q[i-1]) / (q[i] - q[i-1])
	r := delayShape[i-1] + f*(delayShape[i]-delayShape[i-1])
	return time.Duration(r * median * float64(time.Millisecond))
}

// gossipBytes is what gossip costs each node per second over a run of runS
// seconds with events events (announcements, deaths): the idle rate
// (probes, and push/pulls of every member's state every
// pushPullInterval) plus each event sent retransmits times by every member
// (at 25 bytes a transmission, as at 100 members; 46 at 30, where fewer
// events share a packet).
func gossipBytes(nodes, events int, runS float64) float64 {
	n := float64(nodes)
	idle := probeBytesPerS + (stateBytes+stateBytesPerMember*n)/pushPullInterval(nodes).Seconds()
	perEvent := n * float64(retransmits(nodes)) * eventTransmitBytes
	return idle + float64(events)*perEvent/(n*runS)
}

// Measured (bytes as memberlist hands them to the transport, compressed
// and encrypted, without UDP/TCP/IP headers):
const (
	probeBytesPerS      = 163  // a probe (ping and ack) per second
	stateBytes          = 1448 // a push/pull, both ways: fixed part
	stateBytesPerMember = 32.5 // and per member (10-byte names, 40 of meta)
	eventTransmitBytes  = 25.1 // one transmission of one holder event
)

// memberlist's own (util.go): push/pulls grow rarer with the cluster, and
// a broadcast is sent RetransmitMult (4) × ceil(log10(N+1)) times.
func pushPullInterval(nodes int) time.Duration {
	const base = 30 * time.Second // DefaultLANConfig's PushPullInterval
	if nodes <= 32 {
		return base
	}
	return time.Duration(math.Ceil(math.Log2(float64(nodes))-5)+1) * base
}

func retransmits(nodes int) int { return 4 * int(math.Ceil(math.Log10(float64(nodes+1)))) }
