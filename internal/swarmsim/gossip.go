package swarmsim

import (
	"math"
	"time"
)

// The gossip model is fitted to bench/gossip's runs of real memberlist
// (docs/gossip-scale.md has the runs and figures). It holds while the
// events fit memberlist's packets; past about 1,000 members a cluster-wide
// fill's events do not, and gossip is slower than this.

// delayShape is the inverse distribution of the delays from an event until
// a member's Router lists it, over their median, at delayQuantiles (the
// last is 1.25 times the measured p99).
var (
	delayQuantiles = [...]float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1}
	delayShape     = [...]float64{0, 0.528, 0.693, 0.812, 0.914, 1, 1.087, 1.189, 1.334, 1.505, 1.955, 2.444}
)

// gossipDelay is how long after an event one member learns of it, for u
// uniform in [0, 1): the median grows with ln N, the shape stays.
func gossipDelay(nodes int, u float64) time.Duration {
	median := max(100, -68.3+91.3*math.Log(float64(nodes))) // ms
	i := 1
	for i < len(delayQuantiles)-1 && u >= delayQuantiles[i] {
		i++
	}
	f := (u - delayQuantiles[i-1]) / (delayQuantiles[i] - delayQuantiles[i-1])
	r := delayShape[i-1] + f*(delayShape[i]-delayShape[i-1])
	return time.Duration(r * median * float64(time.Millisecond))
}

// gossipBytes is what gossip costs each node per second over a run of runS
// seconds with events events (announcements, deaths): the idle rate
// (probes, and push/pulls of every member's state every
// pushPullInterval) plus each event sent retransmits times by every member.
func gossipBytes(nodes, events int, runS float64) float64 {
	n := float64(nodes)
	idle := probeBytesPerS + (stateBytes+stateBytesPerMember*n)/pushPullInterval(nodes).Seconds()
	perEvent := n * float64(retransmits(nodes)) * eventTransmitBytes
	return idle + float64(events)*perEvent/(n*runS)
}

// Bytes as memberlist hands them to the transport (compressed and
// encrypted, without UDP/TCP/IP headers), measured at 100 members:
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
