// Command linkfloor measures the limit of the network-namespace test bed
// that bench/swarm and bench/mirrorswarm run on: the TCP goodput of one of
// its shaped links one way and both ways at once (as a swarm node's
// carries), each printed as B/goodput, a time ratio.
//
// Two hosts of internal/testbed (root and iproute2), both links shaped to
// B. This program runs itself in each host as the traffic's source and
// sink: -flows TCP connections that send zeros for as long as they may,
// each sink counting the bytes it reads over -seconds, after a second of
// warm-up. One way: h0 sends to h1. Duplex: each sends to the other at the
// same time, and the goodput is the mean of the two directions. Each is
// measured -runs times, alternately; the goodputs are the runs' means.
// The hosts run the TCP congestion control -congestion names, by default
// what a new network namespace takes (the machine's default), and the
// line says which. One JSON line on stdout (logs go to stderr):
//
//	{"bench":"link-floor","link_mbit":B,"flows":K,"seconds":D,
//	 "congestion_control":…,"one_way_goodput_mbit":…,"one_way_floor":B/goodput,
//	 "duplex_goodput_mbit":…,"duplex_floor":B/goodput,
//	 "one_way_floor_by_run":[…],"duplex_floor_by_run":[…]}
//
//	go run ./bench/linkfloor -link-mbit 25
//	go run ./bench/linkfloor -quick   # one run of 3 s windows
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/weightd/weightd/internal/benchfig"
	"github.com/weightd/weightd/internal/benchnet"
	"github.com/weightd/weightd/internal/testbed"
)

// port is the sinks' port on each host.
const port = 7100

// warmup is how long a sink reads before it starts counting: the flows'
// slow start is no part of a long transfer's pace.
const warmup = time.Second

type result struct {
	Bench       string  `json:"bench"`
	LinkMbit    int     `json:"link_mbit"`
	Flows       int     `json:"flows"`
	Seconds     float64 `json:"seconds"`
	Congestion  string  `json:"congestion_control"`
	OneWayMbit  float64 `json:"one_way_goodput_mbit"`
	OneWayFloor float64 `json:"one_way_floor"`
	DuplexMbit  float64 `json:"duplex_goodput_mbit"`
	DuplexFloor float64 `json:"duplex_floor"`
	// Each run's, in order.
	OneWayFloors []float64 `json:"one_way_floor_by_run"`
	DuplexFloors []float64 `json:"duplex_floor_by_run"`
}

func main() {
	var (
		linkMbit, flows int
		runs            int
		window          time.Duration
		quick           bool
		sink, source    string
		congestion      string
	)
	flag.IntVar(&linkMbit, "link-mbit", 100, "both hosts' links, each direction, in Mbit/s")
	flag.IntVar(&flows, "flows", 6, "TCP connections each way (6: a chunk server's upload slots, about a filling node's downloads)")
	flag.IntVar(&runs, "runs", 3, "measurements of each, one after the other; the figures are their means")
	flag.DurationVar(&window, "seconds", 20*time.Second, "how long each sink counts")
	flag.BoolVar(&quick, "quick", false, "3 s windows")
	flag.StringVar(&congestion, "congestion", "", "the hosts' TCP congestion control (cubic, bbr, reno: what the kernel offers); empty: what a new network namespace takes, the machine's default")
	flag.StringVar(&sink, "sink", "", "internal: count the bytes of -flows connections to this address over -seconds, and print them")
	flag.StringVar(&source, "source", "", "internal: send zeros on -flows connections to this address for -seconds and the warm-up")
	flag.Parse()
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("bench/linkfloor: ")

	var err error
	switch {
	case sink != "":
		err = runSink(sink, flows, window)
	case source != "":
		err = runSource(source, flows, warmup+window+time.Second)
	default:
		if quick {
			window, runs = 3*time.Second, 1
		}
		if linkMbit < 1 || flows < 1 || runs < 1 || window <= 0 {
			log.Fatalf("-link-mbit %d, -flows %d, -runs %d, -seconds %v: want each positive", linkMbit, flows, runs, window)
		}
		m := measurer{flows: flows, window: window}
		err = benchnet.RunInterruptible(func(ctx context.Context) error { return run(ctx, m, linkMbit, runs, congestion) })
	}
	if err != nil {
		log.Print(err)
		os.Exit(1)
	}
}

// run builds the two hosts, measures one way and both ways runs times, and
// prints the line.
func run(ctx context.Context, m measurer, linkMbit, runs int, congestion string) error {
	var err error
	if m.exe, err = os.Executable(); err != nil {
		return err
	}
	tb, err := testbed.New(ctx, testbed.Config{Name: fmt.Sprintf("floor-%d", os.Getpid()), Hosts: 2, LinkMbit: linkMbit, Congestion: congestion})
	if err != nil {
		return err
	}
	defer func() {
		if err := tb.Close(); err != nil {
			log.Print(err)
		}
	}()
	h := tb.Hosts()
	r := result{Bench: "link-floor", LinkMbit: linkMbit, Flows: m.flows, Seconds: m.window.Seconds(), Congestion: tb.Congestion()}
	var oneWay, duplex float64
	for i := range runs {
		one, err := m.transfer(ctx, [][2]*testbed.Host{{h[0], h[1]}})
		if err != nil {
			return fmt.Errorf("one way: %w", err)
		}
		both, err := m.transfer(ctx, [][2]*testbed.Host{{h[0], h[1]}, {h[1], h[0]}})
		if err != nil {
			return fmt.Errorf("both ways: %w", err)
		}
		mean := (both[0] + both[1]) / 2
		oneWay, duplex = oneWay+one[0]/float64(runs), duplex+mean/float64(runs)
		r.OneWayFloors = append(r.OneWayFloors, benchfig.Round(float64(linkMbit)/one[0], 3))
		r.DuplexFloors = append(r.DuplexFloors, benchfig.Round(float64(linkMbit)/mean, 3))
		log.Printf("run %d: %d Mbit/s, %d flows, %s: one way %.2f Mbit/s, both ways %.2f and %.2f Mbit/s", i+1, linkMbit, m.flows, r.Congestion, one[0], both[0], both[1])
	}
	r.OneWayMbit, r.OneWayFloor = benchfig.Round(oneWay, 3), benchfig.Round(float64(linkMbit)/oneWay, 3)
	r.DuplexMbit, r.DuplexFloor = benchfig.Round(duplex, 3), benchfig.Round(float64(linkMbit)/duplex, 3)
	return json.NewEncoder(os.Stdout).Encode(r)
}

// measurer runs sources and sinks in the test bed's hosts.
type measurer struct {
	exe    string
	flows  int
	window time.Duration
}

// transfer runs, at once, a transfer from each pair's first host to its
// second, and returns each one's goodput in Mbit/s.
func (m measurer) transfer(ctx context.Context, pairs [][2]*testbed.Host) ([]float64, error) {
	ctx, cancel := context.WithTimeout(ctx, m.window+warmup+time.Minute)
	defer cancel()
	sinks := make([]*exec.Cmd, len(pairs))
	outs := make([]*strings.Builder, len(pairs))
	for i, p := range pairs {
		addr := netip.AddrPortFrom(p[1].Addr, port).String()
		outs[i] = &strings.Builder{}
		sinks[i] = p[1].Command(ctx, m.exe, "-sink", addr, "-flows", strconv.Itoa(m.flows), "-seconds", m.window.String())
		sinks[i].Stdout, sinks[i].Stderr = outs[i], os.Stderr
		if err := sinks[i].Start(); err != nil {
			return nil, err
		}
	}
	sources := make([]*exec.Cmd, len(pairs))
	for i, p := range pairs {
		addr := netip.AddrPortFrom(p[1].Addr, port).String()
		sources[i] = p[0].Command(ctx, m.exe, "-source", addr, "-flows", strconv.Itoa(m.flows), "-seconds", m.window.String())
		sources[i].Stderr = os.Stderr
		if err := sources[i].Start(); err != nil {
			return nil, err
		}
	}
	var errs []error
	for _, c := range sources {
		errs = append(errs, c.Wait())
	}
	rates := make([]float64, len(pairs))
	for i, c := range sinks {
		if err := c.Wait(); err != nil {
			errs = append(errs, fmt.Errorf("sink in %s: %w", pairs[i][1].Name, err))
			continue
		}
		var n int64
		var sec float64
		if _, err := fmt.Sscan(outs[i].String(), &n, &sec); err != nil || sec <= 0 {
			errs = append(errs, fmt.Errorf("sink in %s said %q", pairs[i][1].Name, outs[i].String()))
			continue
		}
		rates[i] = float64(n) * 8 / sec / 1e6
	}
	return rates, errors.Join(errs...)
}

// runSink accepts flows connections on addr, reads them all, and prints the
// bytes read over window, after the warm-up, and the seconds it counted.
func runSink(addr string, flows int, window time.Duration) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	defer ln.Close()
	var got atomic.Int64
	var wg sync.WaitGroup
	for range flows {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			buf := make([]byte, 1<<20)
			for {
				n, err := c.Read(buf)
				got.Add(int64(n))
				if err != nil {
					return
				}
			}
		}()
	}
	time.Sleep(warmup)
	from, at := got.Load(), time.Now()
	time.Sleep(window)
	n, took := got.Load()-from, time.Since(at)
	fmt.Println(n, took.Seconds())
	// The sources stop on their own a second later.
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
	}
	return nil
}

// runSource sends zeros to addr on flows connections for d.
func runSource(addr string, flows int, d time.Duration) error {
	deadline := time.Now().Add(d)
	buf := make([]byte, 1<<20)
	var wg sync.WaitGroup
	errs := make([]error, flows)
	for i := range flows {
		c, err := dial(addr)
		if err != nil {
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			if err := c.SetWriteDeadline(deadline); err != nil {
				errs[i] = err
				return
			}
			for {
				if _, err := c.Write(buf); err != nil {
					if !errors.Is(err, os.ErrDeadlineExceeded) {
						errs[i] = err
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// dial connects to addr, retrying for a few seconds while its sink, started
// just before, is not listening yet.
func dial(addr string) (net.Conn, error) {
	for try := 0; ; try++ {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err == nil || try == 50 {
			return c, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}
