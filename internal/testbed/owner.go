package testbed

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"
)

const (
	// stateDir holds one marker file per live testbed, named after it, that
	// records its owner and subnet, and the lock that serialises claims.
	stateDir = "/run/weightd-testbed"
	// netnsDir is where `ip netns` keeps its named namespaces.
	netnsDir = "/run/netns"
	// subnets is how many /24s 198.18.0.0/15 holds.
	subnets = 512
)

// owner is the process that owns a testbed, and the testbed's subnet.
type owner struct {
	pid    int
	start  uint64 // the process's start time, so that a reused pid is no owner
	subnet int    // index of the testbed's /24 in 198.18.0.0/15
}

// claim records this process as the owner of testbed name and picks a subnet
// no live testbed uses. Under the same lock, it first deletes what testbeds
// of dead owners left behind: their namespaces (and the processes in them)
// and markers, and any wdt-* namespace that no marker accounts for.
func claim(tl tools, name string) (netip.Prefix, error) {
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		return netip.Prefix{}, err
	}
	lock, err := os.OpenFile(stateDir+"/.lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return netip.Prefix{}, err
	}
	defer lock.Close() // releases the flock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return netip.Prefix{}, fmt.Errorf("locking %s: %w", lock.Name(), err)
	}

	live, err := liveOwners()
	if err != nil {
		return netip.Prefix{}, err
	}
	if o, ok := live[name]; ok {
		return netip.Prefix{}, fmt.Errorf("%w: owned by live process %d", ErrInUse, o.pid)
	}
	if err := removeStale(tl, live); err != nil {
		return netip.Prefix{}, fmt.Errorf("removing stale testbeds: %w", err)
	}
	used := make(map[int]bool, len(live))
	for _, o := range live {
		used[o.subnet] = true
	}
	idx := -1
	for i := range subnets {
		if !used[i] {
			idx = i
			break
		}
	}
	if idx < 0 {
		return netip.Prefix{}, fmt.Errorf("all %d subnets of 198.18.0.0/15 are in use", subnets)
	}
	start, err := startTime(os.Getpid())
	if err != nil {
		return netip.Prefix{}, err
	}
	marker := fmt.Sprintf("%d %d %d\n", os.Getpid(), start, idx)
	if err := os.WriteFile(stateDir+"/"+name, []byte(marker), 0o644); err != nil {
		return netip.Prefix{}, err
	}
	return subnetPrefix(idx), nil
}

// release forgets the owner of testbed name.
func release(name string) error {
	if err := os.Remove(stateDir + "/" + name); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// subnetPrefix returns the /24 of index i in 198.18.0.0/15.
func subnetPrefix(i int) netip.Prefix {
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{198, byte(18 + i/256), byte(i % 256), 0}), 24)
}

// liveOwners reads the markers and returns those whose owner still runs, by
// testbed name. Markers of dead owners are left for removeStale.
func liveOwners() (map[string]owner, error) {
	entries, err := os.ReadDir(stateDir)
	if err != nil {
		return nil, err
	}
	live := make(map[string]owner)
	for _, e := range entries {
		if !validName.MatchString(e.Name()) {
			continue // the lock, or not ours
		}
		o, ok := readMarker(stateDir + "/" + e.Name())
		if !ok {
			continue
		}
		if s, err := startTime(o.pid); err == nil && s == o.start {
			live[e.Name()] = o
		}
	}
	return live, nil
}

// readMarker parses a marker file; false if it is unreadable or malformed.
func readMarker(path string) (owner, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return owner{}, false
	}
	f := strings.Fields(string(b))
	if len(f) != 3 {
		return owner{}, false
	}
	pid, err1 := strconv.Atoi(f[0])
	start, err2 := strconv.ParseUint(f[1], 10, 64)
	idx, err3 := strconv.Atoi(f[2])
	if err1 != nil || err2 != nil || err3 != nil || pid < 1 || idx < 0 || idx >= subnets {
		return owner{}, false
	}
	return owner{pid: pid, start: start, subnet: idx}, true
}

// hostSuffix ends the name of a host's namespace.
var hostSuffix = regexp.MustCompile(`-h[0-9]+$`)

// testbedOf returns the name of the testbed that namespace ns belongs to, or
// "" if ns is not named like a testbed's namespace.
func testbedOf(ns string) string {
	rest, ok := strings.CutPrefix(ns, nsPrefix)
	if !ok {
		return ""
	}
	if name, ok := strings.CutSuffix(rest, "-br"); ok {
		return name
	}
	if loc := hostSuffix.FindStringIndex(rest); loc != nil {
		return rest[:loc[0]]
	}
	return ""
}

// removeStale deletes every wdt-* namespace whose testbed has no live owner,
// then the markers of dead owners.
func removeStale(tl tools, live map[string]owner) error {
	var stale []string
	entries, err := os.ReadDir(netnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), nsPrefix) {
			continue
		}
		if _, ok := live[testbedOf(e.Name())]; !ok {
			stale = append(stale, e.Name())
		}
	}
	errs := []error{deleteNamespaces(tl, stale)}
	markers, err := os.ReadDir(stateDir)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, m := range markers {
		if _, ok := live[m.Name()]; !ok && validName.MatchString(m.Name()) {
			errs = append(errs, release(m.Name()))
		}
	}
	return errors.Join(errs...)
}

// startTime returns when process pid started, in clock ticks since boot
// (field 22 of /proc/<pid>/stat).
func startTime(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("parsing /proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	const startField = 22 - 3 // fields after the name start at field 3
	if len(f) <= startField {
		return 0, fmt.Errorf("parsing /proc/%d/stat: %d fields", pid, len(f)+2)
	}
	return strconv.ParseUint(f[startField], 10, 64)
}
