package p2p

import (
	"math"
	"sync/atomic"
	"time"
)

// Upload is one chunk upload in progress, as the upload slots see it.
type Upload struct {
	Sent    int64         // bytes sent so far
	Running time.Duration // since the request was taken
}

// slotLendAfter is how long an upload runs before its pace can lend its
// slot: long enough for its first bytes to have left.
const slotLendAfter = time.Second

// SlotsHeld is how many of a chunk server's uploads hold one of its slots
// slots, uplink being its upload's pace in bytes per second (0: not known
// yet, and every upload holds one). An upload that has run slotLendAfter
// at under half a slot's share of the uplink lends its slot to a new
// request, up to slots of them: its reader is slow (a slow link, a busy
// node, a relay of a chunk that comes slowly), and a slot it held would
// keep that share of the uplink from everyone for many times a chunk's
// time. The simulation applies the same rule to its servers.
func SlotsHeld(uploads []Upload, uplink float64, slots int) int {
	if uplink <= 0 || slots <= 0 {
		return len(uploads)
	}
	floor := uplink / float64(2*slots)
	lent := 0
	for _, u := range uploads {
		if u.Running >= slotLendAfter && float64(u.Sent) < floor*u.Running.Seconds() {
			lent++
		}
	}
	return len(uploads) - min(lent, slots)
}

// upload is one of a ChunkServer's uploads holding or lending a slot.
type upload struct {
	peer  string
	began time.Time
	sent  atomic.Int64
}

// paceMeter estimates a link's pace, a server's upload or a swarm's
// download: the fastest it has carried over a meterWindow lately, halving
// each paceHalfLife so that a link that became slower (a limit, a busy
// host) is followed. It is not safe for concurrent use.
type paceMeter struct {
	at    time.Time
	total int64 // bytes carried by at
	peak  float64
}

const (
	meterWindow  = 2 * time.Second
	paceHalfLife = time.Minute
)

// observe records that total bytes were carried by now, and returns the
// pace.
func (m *paceMeter) observe(now time.Time, total int64) float64 {
	if m.at.IsZero() {
		m.at, m.total = now, total
		return 0
	}
	dt := now.Sub(m.at)
	if dt < meterWindow {
		return m.peak
	}
	m.peak *= math.Exp2(-dt.Seconds() / paceHalfLife.Seconds())
	m.peak = max(m.peak, float64(total-m.total)/dt.Seconds())
	m.at, m.total = now, total
	return m.peak
}
