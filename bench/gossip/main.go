// Command gossip measures weightd's membership gossip (p2p.Membership over
// hashicorp/memberlist, production timings) among N members in this process,
// over memberlist.MockNetwork (internal/gossipnet): no socket is opened. It starts N members
// joined through one seed and waits until each sees all the others; then
//
//   - idle: counts the bytes the members send each other for -idle;
//   - fill: every member announces EventPartial for one blob at a random
//     moment within -spread, then EventComplete -complete-after later (give
//     or take -spread), and the command polls every member's Router every
//     -poll until each lists every other as it announced, or -fill-timeout;
//     the fill's bytes are counted until -drain after that.
//
// Each size prints one JSON line on stdout, {"bench":"gossip",…}: the
// delays from an announcement until another member's Router lists it
// (p50/p99/max over all events and members, polling adds up to -poll), and
// the bytes sent per member per second in both phases. Bytes are
// memberlist's payload: packets and both directions of streams, after
// encryption, before UDP/TCP/IP headers (packets are counted too).
//
//	go run ./bench/gossip -nodes 30,100,300
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/internal/gossipnet"
	"github.com/weightd/weightd/pkg/p2p"
)

type line struct {
	Bench             string  `json:"bench"`
	Nodes             int     `json:"nodes"`
	Encrypted         bool    `json:"encrypted"`
	JoinS             float64 `json:"join_s"`
	IdleS             float64 `json:"idle_s"`
	IdleBytesPerNodeS float64 `json:"idle_bytes_per_node_s"`
	// IdleStreamBytesPerNodeS is the push/pulls' part of it.
	IdleStreamBytesPerNodeS float64 `json:"idle_stream_bytes_per_node_s"`
	IdlePktsPerNodeS        float64 `json:"idle_packets_per_node_s"`
	// IdleStreamBytes is what one stream carried, both ways: a push/pull.
	IdleStreamBytes   float64 `json:"idle_stream_bytes"`
	FillS             float64 `json:"fill_s"`
	FillBytesPerNodeS float64 `json:"fill_bytes_per_node_s"`
	FillPktsPerNodeS  float64 `json:"fill_packets_per_node_s"`
	// EventBytes is what one event costs the cluster: the fill's bytes less
	// the idle rate over the same time, divided by the events.
	EventBytes float64 `json:"event_bytes"`
	Events     int     `json:"events"`
	Missed     int     `json:"missed"` // (event, member) pairs never seen
	PollMs     int64   `json:"poll_ms"`
	DelayP50Ms float64 `json:"delay_p50_ms"`
	DelayP90Ms float64 `json:"delay_p90_ms"`
	DelayP99Ms float64 `json:"delay_p99_ms"`
	DelayMaxMs float64 `json:"delay_max_ms"`
	// DelayDecilesMs are the delays' 0th, 10th, …, 100th percentiles.
	DelayDecilesMs []float64 `json:"delay_deciles_ms"`
	// Each event's p50 and max over the members: how fast it spreads.
	EventMaxP50Ms float64 `json:"event_max_p50_ms"`
	EventMaxMaxMs float64 `json:"event_max_max_ms"`
	RunS          float64 `json:"run_s"`
}

func main() {
	nodes := flag.String("nodes", "30,100,300", "comma-separated cluster sizes")
	idle := flag.Duration("idle", 60*time.Second, "how long to count idle gossip")
	spread := flag.Duration("spread", 2*time.Second, "the window the EventPartial announcements fall in")
	completeAfter := flag.Duration("complete-after", 10*time.Second, "from a member's EventPartial to its EventComplete, give or take -spread/2")
	poll := flag.Duration("poll", 20*time.Millisecond, "how often every Router is read")
	joinTimeout := flag.Duration("join-timeout", 3*time.Minute, "bound on the wait for all members to see all")
	fillTimeout := flag.Duration("fill-timeout", 2*time.Minute, "bound on the fill phase")
	drain := flag.Duration("drain", 10*time.Second, "how long the fill's bytes are counted after every Router listed every event: retransmissions go on")
	encrypt := flag.Bool("encrypt", true, "encrypt gossip with a keyring, as the agent does")
	flag.Parse()
	enc := json.NewEncoder(os.Stdout)
	for f := range strings.SplitSeq(*nodes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 2 || n > 30000 {
			log.Fatalf("bad -nodes %q: 2 to 30000 members", f)
		}
		r := bench{n: n, idle: *idle, spread: *spread, completeAfter: *completeAfter, poll: *poll,
			joinTimeout: *joinTimeout, fillTimeout: *fillTimeout, drain: *drain, encrypt: *encrypt}
		l, err := r.run()
		if err != nil {
			log.Fatalf("%d members: %v", n, err)
		}
		if err := enc.Encode(l); err != nil {
			log.Fatal(err)
		}
	}
}

type bench struct {
	n                                 int
	idle, spread, completeAfter, poll time.Duration
	joinTimeout, fillTimeout, drain   time.Duration
	encrypt                           bool
}

type member struct {
	m *p2p.Membership
	r *p2p.Router
}

func (b bench) run() (line, error) {
	start := time.Now()
	var network gossipnet.Network
	transports := make([]*gossipnet.Transport, b.n)
	for i := range transports { // all before any is used
		transports[i] = network.NewTransport(memberName(i))
	}
	var keys [][]byte
	if b.encrypt {
		keys = [][]byte{[]byte("weightd-gossip-bench-key-32bytes")}
	}
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.WaitGroup
	defer func() { cancel(); running.Wait() }()
	ms := make([]member, b.n)
	for i := range ms {
		cfg := p2p.MembershipConfig{NodeName: memberName(i), Transport: transports[i], SecretKeys: keys,
			Meta: p2p.NodeMeta{ChunkAddr: fmt.Sprintf("10.0.%d.%d:7001", i/250, i%250+1), Zone: "zone-" + strconv.Itoa(i%3), FreeDisk: 1 << 40, Version: "v0.0.0-bench"}}
		if i > 0 {
			cfg.Join = []string{ms[0].m.LocalAddr()}
		}
		r := p2p.NewRouter(0)
		m, err := p2p.NewMembership(cfg, r)
		if err != nil {
			return line{}, err
		}
		ms[i] = member{m: m, r: r}
		running.Go(func() {
			if err := m.Run(ctx); err != nil {
				log.Printf("%s: %v", m.LocalName(), err)
			}
		})
		<-m.Ready()
	}
	joinStart := start
	if err := waitUntil(b.joinTimeout, time.Second/10, func() bool {
		for _, m := range ms {
			if len(m.m.Members()) != b.n-1 {
				return false
			}
		}
		return true
	}); err != nil {
		seen := make([]int, len(ms))
		for i, m := range ms {
			seen[i] = len(m.m.Members())
		}
		slices.Sort(seen)
		return line{}, fmt.Errorf("joining: %w: members seen, least %d, median %d, most %d of %d", err, seen[0], seen[len(seen)/2], seen[len(seen)-1], b.n-1)
	}
	l := line{Bench: "gossip", Nodes: b.n, Encrypted: b.encrypt, JoinS: time.Since(joinStart).Seconds(), PollMs: b.poll.Milliseconds()}
	time.Sleep(10 * time.Second) // the joins' broadcasts drain

	s0, t0 := network.Sent(), time.Now()
	time.Sleep(b.idle)
	s1, t1 := network.Sent(), time.Now()
	l.IdleS = t1.Sub(t0).Seconds()
	idleRate := float64(total(s1)-total(s0)) / l.IdleS
	l.IdleBytesPerNodeS = idleRate / float64(b.n)
	l.IdleStreamBytesPerNodeS = float64(s1.StreamBytes-s0.StreamBytes) / l.IdleS / float64(b.n)
	l.IdlePktsPerNodeS = float64(s1.Packets-s0.Packets) / l.IdleS / float64(b.n)
	if s1.Streams > s0.Streams {
		l.IdleStreamBytes = float64(s1.StreamBytes-s0.StreamBytes) / float64(s1.Streams-s0.Streams)
	}

	delays, missed, err := b.fill(ms)
	time.Sleep(b.drain)
	s2, t2 := network.Sent(), time.Now()
	if err != nil {
		return line{}, err
	}
	l.FillS = t2.Sub(t1).Seconds()
	l.FillBytesPerNodeS = float64(total(s2)-total(s1)) / l.FillS / float64(b.n)
	l.FillPktsPerNodeS = float64(s2.Packets-s1.Packets) / l.FillS / float64(b.n)
	l.Events = 2 * b.n
	l.EventBytes = (float64(total(s2)-total(s1)) - idleRate*l.FillS) / float64(l.Events)
	l.Missed = missed
	var all, eventMax []float64
	for _, ds := range delays {
		all = append(all, ds...)
		if len(ds) > 0 {
			eventMax = append(eventMax, slices.Max(ds))
		}
	}
	l.DelayP50Ms, l.DelayP90Ms, l.DelayP99Ms, l.DelayMaxMs = quantile(all, 0.5), quantile(all, 0.9), quantile(all, 0.99), quantile(all, 1)
	for q := range 11 {
		l.DelayDecilesMs = append(l.DelayDecilesMs, math.Round(quantile(all, float64(q)/10)))
	}
	l.EventMaxP50Ms, l.EventMaxMaxMs = quantile(eventMax, 0.5), quantile(eventMax, 1)
	l.RunS = time.Since(start).Seconds()
	return l, nil
}

// fill has every member announce the blob partial, then complete, and
// returns per event the delays in milliseconds until the other members'
// Routers listed it, and how many (event, member) pairs never did.
func (b bench) fill(ms []member) ([][]float64, int, error) {
	d := digest.FromString("weightd gossip bench")
	n := len(ms)
	announced := make([]atomic.Int64, 2*n) // unix nanoseconds; event 2i partial, 2i+1 complete
	var announcing sync.WaitGroup
	for i, m := range ms {
		partial := time.Duration(rand.Int64N(int64(b.spread)))
		complete := partial + b.completeAfter + time.Duration(rand.Int64N(int64(b.spread))) - b.spread/2
		announcing.Go(func() {
			time.Sleep(partial)
			announced[2*i].Store(time.Now().UnixNano())
			if err := m.m.Announce(p2p.EventPartial, d); err != nil {
				log.Fatal(err)
			}
			time.Sleep(complete - partial)
			announced[2*i+1].Store(time.Now().UnixNano())
			if err := m.m.Announce(p2p.EventComplete, d); err != nil {
				log.Fatal(err)
			}
		})
	}
	index := make(map[string]int, n)
	for i, m := range ms {
		index[m.m.LocalName()] = i
	}
	delays := make([][]float64, 2*n)
	seen := make([][]bool, n) // seen[j][event]
	for j := range seen {
		seen[j] = make([]bool, 2*n)
	}
	left := 2 * n * (n - 1)
	deadline := time.Now().Add(b.fillTimeout)
	for left > 0 && time.Now().Before(deadline) {
		for j, m := range ms {
			hs := m.r.Holders(d)
			now := time.Now().UnixNano()
			for _, h := range hs {
				i, ok := index[h.Peer]
				if !ok {
					return nil, 0, fmt.Errorf("%s lists an unknown holder %q", m.m.LocalName(), h.Peer)
				}
				events := []int{2 * i}
				if h.Complete {
					events = append(events, 2*i+1)
				}
				for _, e := range events {
					if seen[j][e] {
						continue
					}
					at := announced[e].Load()
					if at == 0 { // listed before it was announced: cannot be
						return nil, 0, fmt.Errorf("%s lists event %d before it was announced", m.m.LocalName(), e)
					}
					seen[j][e] = true
					left--
					delays[e] = append(delays[e], float64(now-at)/1e6)
				}
			}
		}
		time.Sleep(b.poll)
	}
	announcing.Wait()
	return delays, left, nil
}

func total(s gossipnet.Sent) int64 { return s.PacketBytes + s.StreamBytes }

func memberName(i int) string { return fmt.Sprintf("node-%05d", i) }

func waitUntil(timeout, every time.Duration, ok func() bool) error {
	deadline := time.Now().Add(timeout)
	for !ok() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not done after %v", timeout)
		}
		time.Sleep(every)
	}
	return nil
}

// quantile returns the q-quantile of xs (nearest rank), 0 for none.
func quantile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}
