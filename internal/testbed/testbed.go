// Package testbed runs several hosts on one machine, for multi-host tests and
// benchmarks.
//
// A Testbed is a set of Linux network namespaces: one holds a bridge
// (wdt-<name>-br), and each host is a namespace of its own (wdt-<name>-h<i>)
// whose eth0 is one end of a veth pair whose other end is a port of the
// bridge. Every host has one IPv4 address in a /24 of 198.18.0.0/15 (the
// benchmarking range) that exists only inside the testbed, so the root
// namespace's interfaces, addresses and routes are never touched and no
// packet of a testbed can leave it (but for Config.LinkRoot, below). Links can be shaped with tbf in both
// directions: egress of the host's eth0 is its upload, egress of its bridge
// port is its download. netem, fq and fq_codel do not exist on every kernel
// weightd is tested on, so the testbed adds no latency; add it in Go if a
// test needs it.
//
// Config.LinkRoot joins the testbed to the network namespace of the
// process that creates it (the machine's own, where a kubelet and its pods'
// host-network agents run): a veth pair from the bridge to that namespace,
// whose end there (wdt<subnet index>) holds the subnet's last address, and
// every host's default route through it. That interface and its /24 route
// are the one thing such a testbed adds outside its namespaces; deleting the
// bridge's namespace (Close, or the clean-up of a dead owner's testbed)
// deletes them.
//
// Processes run inside a host through Host.Command (`ip netns exec`). The
// filesystem is shared: unix sockets and files under a test directory are
// reachable from the root namespace and from every host. So is the
// hostname: a program that names itself after it (a gossip member name)
// must be given the host's Name instead.
//
// Creating a testbed needs root and the iproute2 tools (ip, tc); Available
// says whether they are there, and NewT skips a test without them (or fails
// it under CI=true). Each testbed records its owner under /run: New first
// deletes the namespaces of testbeds whose owner has died (a killed test or
// benchmark), never those of a live one, so testbeds of concurrent test
// binaries coexist.
package testbed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// MaxHosts is the most hosts a testbed holds: one /24 less the network and
// broadcast addresses.
const MaxHosts = 254

// nsPrefix starts the name of every namespace a testbed makes.
const nsPrefix = "wdt-"

// ErrUnavailable is returned (wrapped) by Available and New when the machine
// cannot host a testbed: not root, or ip or tc missing.
var ErrUnavailable = errors.New("testbed unavailable")

// ErrInUse is returned (wrapped) by New when a live process already owns a
// testbed of the requested name.
var ErrInUse = errors.New("testbed name in use")

// Config describes a testbed.
type Config struct {
	// Name names the testbed's namespaces: 1 to 32 of a-z, 0-9 and '-',
	// starting with a letter or digit. Empty means a name unique to this
	// process ("p<pid>-<n>").
	Name string
	// Hosts is how many hosts to create, 1 to MaxHosts.
	Hosts int
	// LinkMbit shapes every host's link to this many Mbit/s in each
	// direction; 0 leaves the links unshaped (several Gbit/s).
	LinkMbit int
	// LinkRoot joins the bridge to the creating process's network
	// namespace, which then reaches the hosts, and they its addresses
	// (see the package doc). It takes the subnet's last address, so the
	// testbed holds at most MaxHosts-1 hosts.
	LinkRoot bool
	// Congestion is every host's TCP congestion control
	// (net.ipv4.tcp_congestion_control in its namespace), one the kernel
	// offers. Empty keeps what a new namespace takes: the machine's
	// default, which need not be Linux's (cubic).
	Congestion string
}

// Testbed is a set of hosts on one bridge. Its methods are safe for
// concurrent use.
type Testbed struct {
	name       string
	subnet     netip.Prefix
	bridgeNS   string
	hosts      []*Host
	tools      tools
	rootAddr   netip.Addr // the creating namespace's address; invalid without LinkRoot
	congestion string     // the hosts' TCP congestion control

	mu       sync.Mutex
	shaped   map[*Host]bool // hosts whose links carry a tbf qdisc
	closed   bool
	closeErr error
}

// Host is one host of a testbed.
type Host struct {
	// Name is the host's name within the testbed: "h0", "h1", …
	Name string
	// NS is the name of the host's network namespace, as `ip netns` knows
	// it: "wdt-<testbed>-h<i>".
	NS string
	// Addr is the host's address on its eth0, reachable from every other
	// host of the testbed.
	Addr netip.Addr

	port string // the host's port on the bridge, in the bridge's namespace
	ip   string // path of the ip tool, for Command
}

var validName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,31}$`)

// validCongestion is the shape of a kernel congestion control's name.
var validCongestion = regexp.MustCompile(`^[a-z0-9_]{1,15}$`)

// autoNames counts the testbeds named by this process.
var autoNames struct {
	sync.Mutex
	n int
}

func (c Config) validate() error {
	switch {
	case c.Name != "" && !validName.MatchString(c.Name):
		return fmt.Errorf("name %q: want 1 to 32 of a-z, 0-9 and '-', not starting with '-'", c.Name)
	case c.Hosts < 1 || c.Hosts > MaxHosts:
		return fmt.Errorf("%d hosts: want 1 to %d", c.Hosts, MaxHosts)
	case c.LinkRoot && c.Hosts == MaxHosts:
		return fmt.Errorf("%d hosts and LinkRoot: want at most %d (the link takes an address)", c.Hosts, MaxHosts-1)
	case c.LinkMbit < 0:
		return fmt.Errorf("link of %d Mbit/s: want 0 (unshaped) or more", c.LinkMbit)
	case c.Congestion != "" && !validCongestion.MatchString(c.Congestion):
		return fmt.Errorf("congestion control %q: want 1 to 15 of a-z, 0-9 and '_'", c.Congestion)
	}
	return nil
}

// tools are the paths of the iproute2 programs.
type tools struct{ ip, tc string }

// findTools looks for ip and tc in PATH, then in /usr/sbin and /sbin (root's
// usual PATH may lack them under some test runners).
func findTools() (tools, error) {
	var t tools
	for _, x := range []struct {
		name string
		dst  *string
	}{{"ip", &t.ip}, {"tc", &t.tc}} {
		p, err := exec.LookPath(x.name)
		if err != nil {
			for _, dir := range []string{"/usr/sbin", "/sbin"} {
				if fi, serr := os.Stat(dir + "/" + x.name); serr == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
					p, err = dir+"/"+x.name, nil
					break
				}
			}
		}
		if err != nil {
			return tools{}, fmt.Errorf("%w: %s not found (install iproute2)", ErrUnavailable, x.name)
		}
		*x.dst = p
	}
	return t, nil
}

// Available returns nil when this process can create testbeds: it runs as
// root and ip and tc are installed. Otherwise the error wraps ErrUnavailable
// and says what is missing.
func Available() error {
	_, err := available()
	return err
}

// available is Available that also returns the tools' paths.
func available() (tools, error) {
	if os.Geteuid() != 0 {
		return tools{}, fmt.Errorf("%w: needs root (network namespaces, veth, tc)", ErrUnavailable)
	}
	return findTools()
}

// New creates a testbed of cfg.Hosts hosts, every link shaped to
// cfg.LinkMbit, and returns it once every host's eth0 is up. ctx bounds the
// set-up only. On error nothing of the testbed is left behind. The caller
// must Close the testbed.
func New(ctx context.Context, cfg Config) (*Testbed, error) {
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("creating testbed: %w", err)
	}
	tl, err := available()
	if err != nil {
		return nil, fmt.Errorf("creating testbed: %w", err)
	}
	if cfg.Name == "" {
		autoNames.Lock()
		autoNames.n++
		cfg.Name = fmt.Sprintf("p%d-%d", os.Getpid(), autoNames.n)
		autoNames.Unlock()
	}
	subnet, err := claim(tl, cfg.Name)
	if err != nil {
		return nil, fmt.Errorf("creating testbed %s: %w", cfg.Name, err)
	}
	t := &Testbed{
		name:     cfg.Name,
		subnet:   subnet,
		bridgeNS: nsPrefix + cfg.Name + "-br",
		tools:    tl,
		shaped:   make(map[*Host]bool),
	}
	base := subnet.Addr().As4()
	for i := range cfg.Hosts {
		a := base
		a[3] = byte(i + 1)
		t.hosts = append(t.hosts, &Host{
			Name: "h" + strconv.Itoa(i),
			NS:   fmt.Sprintf("%s%s-h%d", nsPrefix, cfg.Name, i),
			Addr: netip.AddrFrom4(a),
			port: "p" + strconv.Itoa(i),
			ip:   tl.ip,
		})
	}
	if cfg.LinkRoot {
		a := base
		a[3] = MaxHosts
		t.rootAddr = netip.AddrFrom4(a)
	}
	if err := t.build(ctx, cfg.LinkMbit, cfg.Congestion); err != nil {
		if cerr := t.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("cleaning up: %w", cerr))
		}
		return nil, fmt.Errorf("creating testbed %s: %w", cfg.Name, err)
	}
	return t, nil
}

// build creates the bridge and the hosts.
func (t *Testbed) build(ctx context.Context, mbit int, congestion string) error {
	br := t.bridgeNS
	steps := [][]string{
		{"netns", "add", br},
		{"-n", br, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"},
		{"-n", br, "link", "set", "br0", "up"},
	}
	for _, h := range t.hosts {
		addr := netip.PrefixFrom(h.Addr, t.subnet.Bits()).String()
		steps = append(steps,
			[]string{"netns", "add", h.NS},
			// Created from inside the bridge's namespace, both ends straight
			// in their namespaces: the root namespace never sees them.
			[]string{"-n", br, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.NS},
			[]string{"-n", br, "link", "set", h.port, "master", "br0", "up"},
			[]string{"-n", h.NS, "link", "set", "lo", "up"},
			[]string{"-n", h.NS, "addr", "add", addr, "dev", "eth0"},
			[]string{"-n", h.NS, "link", "set", "eth0", "up"},
		)
	}
	if t.rootAddr.IsValid() {
		// Created from this namespace, its end here named after the
		// subnet: unique among live testbeds and within 15 bytes. A
		// leftover of a dead testbed whose namespace is still being torn
		// down is deleted first (an error: there was none).
		b := t.subnet.Addr().As4()
		dev := "wdt" + strconv.Itoa((int(b[1])-18)*256+int(b[2]))
		_ = run(ctx, t.tools.ip, "link", "del", dev)
		steps = append(steps,
			[]string{"link", "add", dev, "type", "veth", "peer", "name", "root", "netns", br},
			[]string{"-n", br, "link", "set", "root", "master", "br0", "up"},
			[]string{"addr", "add", netip.PrefixFrom(t.rootAddr, t.subnet.Bits()).String(), "dev", dev},
			[]string{"link", "set", dev, "up"},
		)
		for _, h := range t.hosts {
			steps = append(steps, []string{"-n", h.NS, "route", "add", "default", "via", t.rootAddr.String()})
		}
	}
	for _, s := range steps {
		if err := run(ctx, t.tools.ip, s...); err != nil {
			return err
		}
	}
	if mbit > 0 {
		for _, h := range t.hosts {
			if err := t.SetLink(h, mbit); err != nil {
				return err
			}
		}
	}
	return t.setCongestion(ctx, congestion)
}

const congestionSysctl = "/proc/sys/net/ipv4/tcp_congestion_control"

// setCongestion sets every host's TCP congestion control to name, unless
// it is empty, and records the one the hosts run.
func (t *Testbed) setCongestion(ctx context.Context, name string) error {
	if name != "" {
		for _, h := range t.hosts {
			var stderr bytes.Buffer
			cmd := h.Command(ctx, "tee", congestionSysctl)
			cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(name+"\n"), io.Discard, &stderr
			if err := cmd.Run(); err != nil {
				avail, _ := os.ReadFile("/proc/sys/net/ipv4/tcp_available_congestion_control")
				return fmt.Errorf("setting %s's TCP congestion control to %q (available: %s): %w: %s",
					h.Name, name, bytes.TrimSpace(avail), err, bytes.TrimSpace(stderr.Bytes()))
			}
		}
	}
	out, err := t.hosts[0].Command(ctx, "cat", congestionSysctl).Output()
	if err != nil {
		return fmt.Errorf("reading %s's TCP congestion control: %w", t.hosts[0].Name, err)
	}
	t.congestion = strings.TrimSpace(string(out))
	return nil
}

// Name returns the testbed's name, the middle of its namespaces' names.
func (t *Testbed) Name() string { return t.name }

// Subnet returns the testbed's /24, in which every host has its address.
func (t *Testbed) Subnet() netip.Prefix { return t.subnet }

// Congestion returns the TCP congestion control the hosts run (Config).
func (t *Testbed) Congestion() string { return t.congestion }

// RootAddr returns the address of the creating process's namespace on the
// testbed's subnet, the hosts' default gateway; the zero Addr (invalid)
// without Config.LinkRoot.
func (t *Testbed) RootAddr() netip.Addr { return t.rootAddr }

// Hosts returns the testbed's hosts, h0 first. The slice is the caller's.
func (t *Testbed) Hosts() []*Host { return append([]*Host(nil), t.hosts...) }

// Command returns a command that runs name with args inside the host's
// network namespace (through `ip netns exec`, which execs it: the
// command's process is the program itself, and signals reach it directly).
// The filesystem, the environment and the user are the caller's. The
// process is sent SIGKILL if the thread that started it dies (Pdeathsig), so
// that a killed test leaves nothing running; Close also kills whatever still
// runs in the testbed.
func (h *Host) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, h.ip, append([]string{"netns", "exec", h.NS, name}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// SetLink shapes h's link to mbit Mbit/s in each direction (a tbf qdisc on
// the egress of its eth0 for its upload, and of its bridge port for its
// download), or removes the shaping when mbit is 0.
func (t *Testbed) SetLink(h *Host, mbit int) error {
	if mbit < 0 {
		return fmt.Errorf("shaping %s: %d Mbit/s: want 0 (unshaped) or more", h.Name, mbit)
	}
	if err := t.check(h); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("shaping %s: testbed %s is closed", h.Name, t.name)
	}
	ctx := context.Background()
	for _, side := range []struct{ ns, dev string }{{h.NS, "eth0"}, {t.bridgeNS, h.port}} {
		var err error
		switch {
		case mbit > 0:
			err = run(ctx, t.tools.tc, append([]string{"-n", side.ns, "qdisc", "replace", "dev", side.dev, "root"}, tbf(mbit)...)...)
		case t.shaped[h]:
			err = run(ctx, t.tools.tc, "-n", side.ns, "qdisc", "del", "dev", side.dev, "root")
		}
		if err != nil {
			return fmt.Errorf("shaping %s: %w", h.Name, err)
		}
	}
	t.shaped[h] = mbit > 0
	return nil
}

// tbf returns the arguments of a tbf qdisc at mbit Mbit/s. The bucket holds
// 4 ms at that rate but at least 64 KiB, so that a GSO packet of veth passes
// whole and the rate is met at any speed (measured from 10 Mbit/s to
// 1 Gbit/s: TCP goodput is 96% of the rate, the rest being headers); the
// queue holds 50 ms more, enough for a few TCP flows without loss storms.
func tbf(mbit int) []string {
	burst := max(int64(mbit)*1_000_000/8*4/1000, 64<<10)
	return []string{"tbf", "rate", strconv.Itoa(mbit) + "mbit", "burst", strconv.FormatInt(burst, 10), "latency", "50ms"}
}

// Down cuts h off: its bridge port goes down, so its packets are dropped
// silently, as when a cable is pulled or a node partitioned (connections
// time out rather than being refused). Up undoes it.
func (t *Testbed) Down(h *Host) error { return t.setPort(h, "down") }

// Up reconnects a host cut off by Down.
func (t *Testbed) Up(h *Host) error { return t.setPort(h, "up") }

func (t *Testbed) setPort(h *Host, state string) error {
	if err := t.check(h); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return fmt.Errorf("setting %s %s: testbed %s is closed", h.Name, state, t.name)
	}
	if err := run(context.Background(), t.tools.ip, "-n", t.bridgeNS, "link", "set", h.port, state); err != nil {
		return fmt.Errorf("setting %s %s: %w", h.Name, state, err)
	}
	return nil
}

// check returns an error unless h is one of t's hosts.
func (t *Testbed) check(h *Host) error {
	if h == nil {
		return fmt.Errorf("nil host for testbed %s", t.name)
	}
	if slices.Contains(t.hosts, h) {
		return nil
	}
	return fmt.Errorf("host %s (%s) is not of testbed %s", h.Name, h.NS, t.name)
}

// Close kills every process still running in the testbed's namespaces,
// deletes the namespaces (and with them the veth pairs, the bridge and the
// shaping) and releases the testbed's name and subnet. It may be called more
// than once; later calls return the first call's result.
func (t *Testbed) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return t.closeErr
	}
	t.closed = true
	names := []string{t.bridgeNS}
	for _, h := range t.hosts {
		names = append(names, h.NS)
	}
	err := deleteNamespaces(t.tools, names)
	if rerr := release(t.name); rerr != nil {
		err = errors.Join(err, rerr)
	}
	if err != nil {
		t.closeErr = fmt.Errorf("closing testbed %s: %w", t.name, err)
	}
	return t.closeErr
}

// deleteNamespaces kills the processes in each named namespace and deletes
// it. A namespace that does not exist is not an error.
func deleteNamespaces(tl tools, names []string) error {
	var errs []error
	for _, ns := range names {
		if _, err := os.Stat(netnsDir + "/" + ns); errors.Is(err, os.ErrNotExist) {
			continue
		}
		out, err := exec.Command(tl.ip, "netns", "pids", ns).Output()
		if err == nil {
			for _, f := range strings.Fields(string(out)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 1 && pid != os.Getpid() {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		if err := run(context.Background(), tl.ip, "netns", "del", ns); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// run runs one ip or tc command and returns its output in the error.
func run(ctx context.Context, tool string, args ...string) error {
	out, err := exec.CommandContext(ctx, tool, args...).CombinedOutput()
	if err != nil {
		name := tool[strings.LastIndexByte(tool, '/')+1:]
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
