package testbed

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestConfigRejected(t *testing.T) {
	t.Parallel()
	for _, cfg := range []Config{
		{Hosts: 0},
		{Hosts: MaxHosts + 1},
		{Hosts: 2, LinkMbit: -1},
		{Name: "Upper", Hosts: 2},
		{Name: "-lead", Hosts: 2},
		{Name: "has_underscore", Hosts: 2},
		{Name: strings.Repeat("a", 33), Hosts: 2},
		{Hosts: MaxHosts, LinkRoot: true},
	} {
		if tb, err := New(t.Context(), cfg); err == nil {
			tb.Close()
			t.Errorf("New(%+v) succeeded", cfg)
		} else if errors.Is(err, ErrUnavailable) {
			t.Errorf("New(%+v): %v, want a configuration error", cfg, err)
		}
	}
}

func TestTestbedOf(t *testing.T) {
	t.Parallel()
	for ns, want := range map[string]string{
		"wdt-swarm-br":     "swarm",
		"wdt-swarm-h0":     "swarm",
		"wdt-swarm-h17":    "swarm",
		"wdt-p12-3-h4":     "p12-3",
		"wdt-a-h1-br":      "a-h1",
		"wdt-a-h1-h2":      "a-h1",
		"wdt-x":            "",
		"wdt-x-hy":         "",
		"other-swarm-br":   "",
		"wdt-swarm-h":      "",
		"wdt-swarm-br-h01": "swarm-br",
	} {
		if got := testbedOf(ns); got != want {
			t.Errorf("testbedOf(%q) = %q, want %q", ns, got, want)
		}
	}
}

func TestSubnetPrefix(t *testing.T) {
	t.Parallel()
	for i, want := range map[int]string{0: "198.18.0.0/24", 255: "198.18.255.0/24", 256: "198.19.0.0/24", subnets - 1: "198.19.255.0/24"} {
		if got := subnetPrefix(i).String(); got != want {
			t.Errorf("subnetPrefix(%d) = %s, want %s", i, got, want)
		}
	}
}

// rootView is what the root namespace's interfaces look like.
func rootView(t *testing.T) []string {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, i := range ifs {
		addrs, err := i.Addrs()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("%s %v", i.Name, addrs))
	}
	slices.Sort(out)
	return out
}

func TestEchoBetweenHosts(t *testing.T) {
	t.Parallel()
	Require(t)
	before := rootView(t)
	tb := NewT(t, Config{Hosts: 2})
	if after := rootView(t); !slices.Equal(before, after) {
		t.Errorf("root namespace changed:\nbefore %q\nafter  %q", before, after)
	}
	hosts := tb.Hosts()
	if len(hosts) != 2 {
		t.Fatalf("%d hosts, want 2", len(hosts))
	}
	for i, h := range hosts {
		if want := fmt.Sprintf("wdt-%s-h%d", tb.Name(), i); h.NS != want || h.Name != "h"+strconv.Itoa(i) {
			t.Errorf("host %d is %s in %s, want h%d in %s", i, h.Name, h.NS, i, want)
		}
		if !tb.Subnet().Contains(h.Addr) || !netip.MustParsePrefix("198.18.0.0/15").Contains(h.Addr) {
			t.Errorf("%s has %s, outside %s", h.Name, h.Addr, tb.Subnet())
		}
	}
	if hosts[0].Addr == hosts[1].Addr {
		t.Fatalf("both hosts have %s", hosts[0].Addr)
	}
	addr := netip.AddrPortFrom(hosts[0].Addr, 7000).String()
	serve(t, hosts[0], "echo", addr)
	got, err := send(t, hosts[1], addr, "hello from h1")
	if err != nil || got != "hello from h1" {
		t.Fatalf("echo from h1 to h0: %q, %v", got, err)
	}
	// Each host has its own loopback.
	serve(t, hosts[1], "echo", "127.0.0.1:7001")
	if got, err := send(t, hosts[1], "127.0.0.1:7001", "lo"); err != nil || got != "lo" {
		t.Errorf("echo on h1's loopback: %q, %v", got, err)
	}
	if _, err := send(t, hosts[0], "127.0.0.1:7001", "lo"); err == nil {
		t.Errorf("h0 reached h1's loopback server")
	}
}

// transfer sends size bytes from one host to the other and returns the
// receiver's rate in Mbit/s.
func transfer(t *testing.T, from, to *Host, port uint16, size int64) float64 {
	t.Helper()
	addr := netip.AddrPortFrom(to.Addr, port).String()
	out := serve(t, to, "sink", addr)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := helper(t, ctx, from, "source", addr, strconv.FormatInt(size, 10)).Run(); err != nil {
		t.Fatalf("sending from %s: %v", from.Name, err)
	}
	return sinkRate(t, out, size)
}

// sinkRate reads a sink's result and returns its rate in Mbit/s.
func sinkRate(t *testing.T, out *bufio.Reader, size int64) float64 {
	t.Helper()
	line, err := out.ReadString('\n')
	if err != nil {
		t.Fatalf("reading the sink's result: %v", err)
	}
	var (
		n   int64
		sec float64
	)
	if _, err := fmt.Sscan(line, &n, &sec); err != nil || n != size || sec <= 0 {
		t.Fatalf("sink said %q (%v), want %d bytes", line, err, size)
	}
	return float64(n) * 8 / sec / 1e6
}

func TestShapedThroughput(t *testing.T) {
	Require(t)
	const (
		mbit = 100
		size = 8 << 20
	)
	tb := NewT(t, Config{Hosts: 2, LinkMbit: mbit})
	h := tb.Hosts()
	steps := []struct {
		name     string
		from, to int // links of h0 (the sender) and h1 (the receiver)
		lo, hi   float64
	}{
		{name: "both", from: mbit, to: mbit, lo: 0.6, hi: 1.1},
		{name: "upload", from: mbit, to: 0, lo: 0.6, hi: 1.1},
		{name: "download", from: 0, to: mbit, lo: 0.6, hi: 1.1},
		{name: "unshaped", from: 0, to: 0, lo: 2, hi: 1e9},
	}
	for i, s := range steps {
		if err := tb.SetLink(h[0], s.from); err != nil {
			t.Fatal(err)
		}
		if err := tb.SetLink(h[1], s.to); err != nil {
			t.Fatal(err)
		}
		rate := transfer(t, h[0], h[1], uint16(7100+i), size)
		ratio := rate / mbit
		t.Logf("%s: %.1f Mbit/s, %.2f of %d", s.name, rate, ratio, mbit)
		if ratio < s.lo || ratio > s.hi {
			t.Errorf("%s: %.1f Mbit/s is %.2f of %d Mbit/s, want %.1f to %.1f", s.name, rate, ratio, mbit, s.lo, s.hi)
		}
	}
}

// Every host sends to the next and receives from the previous at once, as in
// a swarm: each link carries its rate both ways.
func TestFullDuplexRing(t *testing.T) {
	Require(t)
	const (
		hosts = 4
		mbit  = 100
		size  = 8 << 20
	)
	tb := NewT(t, Config{Hosts: hosts, LinkMbit: mbit})
	h := tb.Hosts()
	var sinks []*bufio.Reader
	for _, x := range h {
		sinks = append(sinks, serve(t, x, "sink", netip.AddrPortFrom(x.Addr, 7400).String()))
	}
	errs := make([]error, hosts)
	var wg sync.WaitGroup
	for i, x := range h {
		to := netip.AddrPortFrom(h[(i+1)%hosts].Addr, 7400).String()
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			errs[i] = helper(t, ctx, x, "source", to, strconv.Itoa(size)).Run()
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for i, out := range sinks {
		rate := sinkRate(t, out, size)
		if ratio := rate / mbit; ratio < 0.6 || ratio > 1.1 {
			t.Errorf("h%d received %.1f Mbit/s, %.2f of %d, want 0.6 to 1.1", i, rate, ratio, mbit)
		}
	}
}

func TestDownUp(t *testing.T) {
	t.Parallel()
	tb := NewT(t, Config{Hosts: 2})
	h := tb.Hosts()
	addr := netip.AddrPortFrom(h[0].Addr, 7200).String()
	serve(t, h[0], "echo", addr)
	if _, err := send(t, h[1], addr, "before"); err != nil {
		t.Fatalf("before Down: %v", err)
	}
	if err := tb.Down(h[0]); err != nil {
		t.Fatal(err)
	}
	if got, err := send(t, h[1], addr, "down"); err == nil {
		t.Fatalf("h0 is down but echoed %q", got)
	}
	if err := tb.Up(h[0]); err != nil {
		t.Fatal(err)
	}
	var err error
	for range 10 { // the port forwards at once; allow ARP a moment
		if _, err = send(t, h[1], addr, "after"); err == nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("after Up: %v", err)
	}
}

func TestCloseRemovesEverything(t *testing.T) {
	t.Parallel()
	Require(t)
	tb, err := New(t.Context(), Config{Hosts: 3, LinkMbit: 50})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tb.Close() })
	sleeper := tb.Hosts()[1].Command(context.Background(), "sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- sleeper.Wait() }()

	if _, err := New(t.Context(), Config{Name: tb.Name(), Hosts: 1}); !errors.Is(err, ErrInUse) {
		t.Errorf("second testbed named %s: %v, want ErrInUse", tb.Name(), err)
	}
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err == nil {
			t.Errorf("the process in the testbed exited on its own, before Close killed it")
		}
	case <-time.After(5 * time.Second):
		_ = sleeper.Process.Kill()
		t.Errorf("a process in the testbed outlived Close")
	}
	assertGone(t, tb.Name())
	if err := tb.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := tb.SetLink(tb.Hosts()[0], 10); err == nil {
		t.Errorf("SetLink after Close succeeded")
	}
}

// assertGone checks that nothing of testbed name is left.
func assertGone(t *testing.T, name string) {
	t.Helper()
	entries, err := os.ReadDir(netnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	for _, e := range entries {
		if testbedOf(e.Name()) == name {
			t.Errorf("namespace %s is left", e.Name())
		}
	}
	if _, err := os.Stat(stateDir + "/" + name); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("marker of %s is left (%v)", name, err)
	}
}

func TestStaleTestbedRemoved(t *testing.T) {
	t.Parallel()
	Require(t)
	tl, err := findTools()
	if err != nil {
		t.Fatal(err)
	}
	// A dead owner: a process that has exited.
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("stale%d", os.Getpid())
	orphan := fmt.Sprintf("wdt-orphan%d-h0", os.Getpid()) // no marker at all
	for _, ns := range []string{nsPrefix + name + "-br", nsPrefix + name + "-h0", orphan} {
		if err := run(t.Context(), tl.ip, "netns", "add", ns); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := deleteNamespaces(tl, []string{ns}); err != nil {
				t.Error(err)
			}
		})
	}
	if err := os.WriteFile(stateDir+"/"+name, fmt.Appendf(nil, "%d 1 7\n", dead.Process.Pid), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := release(name); err != nil {
			t.Error(err)
		}
	})

	NewT(t, Config{Hosts: 1})
	assertGone(t, name)
	if _, err := os.Stat(netnsDir + "/" + orphan); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("orphan namespace %s is left (%v)", orphan, err)
	}
}

func TestManyHosts(t *testing.T) {
	t.Parallel()
	Require(t)
	start := time.Now()
	tb := NewT(t, Config{Hosts: 20, LinkMbit: 100})
	t.Logf("20 shaped hosts up in %v", time.Since(start).Round(time.Millisecond))
	hosts := tb.Hosts()
	seen := make(map[netip.Addr]bool)
	for _, h := range hosts {
		if seen[h.Addr] {
			t.Errorf("%s shares %s", h.Name, h.Addr)
		}
		seen[h.Addr] = true
	}
	addr := netip.AddrPortFrom(hosts[0].Addr, 7300).String()
	serve(t, hosts[0], "echo", addr)
	for _, h := range []*Host{hosts[1], hosts[10], hosts[19]} {
		if got, err := send(t, h, addr, h.Name); err != nil || got != h.Name {
			t.Errorf("echo from %s to h0: %q, %v", h.Name, got, err)
		}
	}
}

// TestLinkRoot is not parallel: the link changes the root namespace's
// interfaces, which other tests check are untouched.
func TestLinkRoot(t *testing.T) {
	Require(t)
	before := rootView(t)
	tb, err := New(t.Context(), Config{Hosts: 2, LinkRoot: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tb.Close() })
	root := tb.RootAddr()
	if !tb.Subnet().Contains(root) || slices.ContainsFunc(tb.Hosts(), func(h *Host) bool { return h.Addr == root }) {
		t.Fatalf("root address %s: outside %s or a host's", root, tb.Subnet())
	}

	// A host reaches a server of this namespace, through its default route.
	ln, err := net.Listen("tcp", netip.AddrPortFrom(root, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			line, _ := bufio.NewReader(c).ReadString('\n')
			fmt.Fprint(c, line)
			c.Close()
		}
	}()
	h := tb.Hosts()[1]
	if got, err := send(t, h, ln.Addr().String(), "to the root"); err != nil || got != "to the root" {
		t.Fatalf("echo from %s to the root namespace: %q, %v", h.Name, got, err)
	}
	// And this namespace reaches a host's server.
	addr := netip.AddrPortFrom(h.Addr, 7000).String()
	serve(t, h, "echo", addr)
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dialing %s from the root namespace: %v", addr, err)
	}
	fmt.Fprintln(c, "from the root")
	got, err := bufio.NewReader(c).ReadString('\n')
	c.Close()
	if err != nil || got != "from the root\n" {
		t.Fatalf("echo from the root namespace to %s: %q, %v", h.Name, got, err)
	}

	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	// The root end goes with the bridge's namespace, asynchronously.
	deadline := time.Now().Add(10 * time.Second)
	for after := rootView(t); !slices.Equal(before, after); after = rootView(t) {
		if time.Now().After(deadline) {
			t.Fatalf("root namespace after Close:\nbefore %q\nafter  %q", before, after)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Every host runs the congestion control the testbed was given, and the
// testbed says which one its hosts run, given or not; one the kernel does
// not offer is an error.
func TestCongestionControl(t *testing.T) {
	Require(t)
	machine, err := os.ReadFile("/proc/sys/net/ipv4/tcp_congestion_control")
	if err != nil {
		t.Fatal(err)
	}
	if got := NewT(t, Config{Hosts: 1}).Congestion(); got != strings.TrimSpace(string(machine)) {
		t.Errorf("default: the testbed says %q, the machine runs %q", got, machine)
	}
	tb := NewT(t, Config{Hosts: 2, Congestion: "reno"})
	if got := tb.Congestion(); got != "reno" {
		t.Errorf("Congestion() = %q, want reno", got)
	}
	for _, h := range tb.Hosts() {
		out, err := h.Command(t.Context(), "cat", "/proc/sys/net/ipv4/tcp_congestion_control").Output()
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(string(out)); got != "reno" {
			t.Errorf("%s runs %q, want reno", h.Name, got)
		}
	}
	if _, err := New(t.Context(), Config{Hosts: 1, Congestion: "nosuch"}); err == nil || !strings.Contains(err.Error(), "nosuch") {
		t.Errorf("an unknown congestion control: %v, want an error naming it", err)
	}
	if _, err := New(t.Context(), Config{Hosts: 1, Congestion: "../x"}); err == nil {
		t.Error("a congestion control name with a slash: no error")
	}
}
