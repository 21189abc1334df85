package p2p

import (
	"math"
	"sync/atomic"
	"time"
)

// Upload is one chunk upload in progress, as the upload slots see it.
type Upload struct {
	Sent    int64         // bytes sent so far
	Size    int64         // the chunk's bytes (0: not known yet)
	Running time.Duration // since the request was taken
}

// slotLendAfter is how long an upload runs before its pace can lend its
// slot: long enough for its first bytes to have left. On a fast uplink
// that is sooner: once the whole chunk would have left at the pace that
// lends (a 16 MiB chunk on 10 Gbit/s in 161 ms, where a 1 GiB blob
// crosses in under a second), and slotLendMin at least.
const (
	slotLendAfter = time.Second
	slotLendMin   = 100 * time.Millisecond
)

// SlotsHeld is how many of a chunk server's uploads hold one of its slots
// slots, uplink being its upload's pace in bytes per second (0: not known
// yet, and every upload holds one). An upload that has run slotLendAfter
// (less on a fast uplink: lends) at under half a slot's share of the
// uplink lends its slot to a new request, up to slots of them: its reader
// is slow (a slow link, a busy node, a relay of a chunk that comes
// slowly), and a slot it held would keep that share of the uplink from
// everyone for many times a chunk's time. The simulation applies the same
// rule to its servers.
func SlotsHeld(uploads []Upload, uplink float64, slots int) int {
	if uplink <= 0 || slots <= 0 {
		return len(uploads)
	}
	lent := 0
	for _, u := range uploads {
		if u.lends(uplink, slots) {
			lent++
		}
	}
	return len(uploads) - min(lent, slots)
}

// lends reports whether u has run slotLendAfter (or its chunk's time at
// the floor, if sooner) at under half a slot's share of uplink, the floor,
// over slots slots (SlotsHeld).
func (u Upload) lends(uplink float64, slots int) bool {
	if uplink <= 0 || slots <= 0 {
		return false
	}
	floor := uplink / float64(2*slots)
	after := slotLendAfter
	if u.Size > 0 {
		after = max(slotLendMin, min(after, time.Duration(float64(u.Size)/floor*float64(time.Second))))
	}
	return u.Running >= after && float64(u.Sent) < floor*u.Running.Seconds()
}

// SendsOnce reports whether a server that holds a whole blob, with slots
// upload slots of which held are held and uplink its upload's pace,
// refuses a chunk that sending, its uploads of that chunk in progress,
// already carry: one of them moves at a fair pace (it does not lend its
// slot), and the upload is busy. Such a holder is the only source of the
// chunks no one else has yet (one that pulled the image first, say): a
// second copy would take its upload from them, while the chunk's receiver
// relays it to the others as it comes. A slow reader's send keeps the
// chunk from no one once it lends its slot, and an idle upload sends
// repeats. The simulation applies the same rule to its servers.
func SendsOnce(sending []Upload, held, slots int, uplink float64) bool {
	if slots <= 0 || held <= slots/2 {
		return false
	}
	for _, u := range sending {
		if !u.lends(uplink, slots) {
			return true
		}
	}
	return false
}

// upload is one of a ChunkServer's uploads holding or lending a slot.
type upload struct {
	peer  string
	chunk chunkKey // what it sends
	began time.Time
	size  atomic.Int64 // the chunk's bytes, once opened
	sent  atomic.Int64
}

// paceMeter estimates a link's pace, a server's upload or a swarm's
// download: the fastest it has carried over a meterWindow (or meterBytes)
// lately, halving each paceHalfLife so that a link that became slower (a
// limit, a busy host) is followed. It is not safe for concurrent use.
type paceMeter struct {
	at    time.Time
	total int64 // bytes carried by at
	peak  float64
}

const (
	meterWindow  = 2 * time.Second
	paceHalfLife = time.Minute
)

// On a fast link a window may end sooner, once meterBytes have passed in
// meterMinWindow at least: many times what socket buffers take at once,
// so a burst into them is not read as the link's pace.
const (
	meterBytes     = 64 << 20
	meterMinWindow = 100 * time.Millisecond
)

// observe records that total bytes were carried by now, and returns the
// pace.
func (m *paceMeter) observe(now time.Time, total int64) float64 {
	if m.at.IsZero() {
		m.at, m.total = now, total
		return 0
	}
	dt := now.Sub(m.at)
	if dt < meterWindow && (dt < meterMinWindow || total-m.total < meterBytes) {
		return m.peak
	}
	m.peak *= math.Exp2(-dt.Seconds() / paceHalfLife.Seconds())
	m.peak = max(m.peak, float64(total-m.total)/dt.Seconds())
	m.at, m.total = now, total
	return m.peak
}
