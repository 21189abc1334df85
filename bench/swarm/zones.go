package main

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"

	"github.com/weightd/weightd/internal/benchfig"
)

// With -zones Z the agent hosts are cut into Z zones of consecutive hosts,
// and each mode runs twice: with the agents told nothing of zones, then
// with --zone. Either way the bench counts the bytes each zone receives
// from outside it, the origin's and the other zones' hosts' apart: an
// iptables rule per outside address in each host's INPUT chain counts the
// IP packets (headers, gossip and chunk states included) as they arrive.

// zoneOf is the zone of agent host i.
func (b *bench) zoneOf(i int) int { return i * b.zones / len(b.hosts) }

// zoneFlag is the --zone flag of agent host i, for AgentConfig.HostExtra.
func (b *bench) zoneFlag(i int) []string {
	return []string{"--zone", fmt.Sprintf("zone-%d", b.zoneOf(i))}
}

// countZones adds the counting rules: in each agent host, one for the
// origin and one for each host of another zone.
func (b *bench) countZones(ctx context.Context) error {
	if _, err := exec.LookPath("iptables"); err != nil {
		return fmt.Errorf("-zones counts bytes with iptables (apt-get install iptables): %w", err)
	}
	for i, h := range b.hosts {
		outside := []string{b.origin.String()}
		for j, o := range b.hosts {
			if b.zoneOf(j) != b.zoneOf(i) {
				outside = append(outside, o.Addr.String())
			}
		}
		for _, addr := range outside {
			if out, err := h.Command(ctx, "iptables", "-A", "INPUT", "-s", addr, "-j", "RETURN").CombinedOutput(); err != nil {
				return fmt.Errorf("iptables in %s: %w: %s", h.Name, err, bytes.TrimSpace(out))
			}
		}
	}
	return nil
}

// zoneBytes is, for each zone, the bytes its hosts have received so far
// from the origin and from the hosts of other zones.
type zoneBytes struct{ origin, peers []int64 }

func (b *bench) readZones(ctx context.Context) (zoneBytes, error) {
	z := zoneBytes{origin: make([]int64, b.zones), peers: make([]int64, b.zones)}
	for i, h := range b.hosts {
		out, err := h.Command(ctx, "iptables", "-L", "INPUT", "-v", "-x", "-n").Output()
		if err != nil {
			return z, fmt.Errorf("iptables in %s: %w", h.Name, err)
		}
		// pkts bytes target prot opt in out source destination
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Fields(line)
			if len(f) < 9 || f[2] != "RETURN" {
				continue
			}
			n, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return z, fmt.Errorf("iptables in %s: %q: %w", h.Name, line, err)
			}
			if f[7] == b.origin.String() {
				z.origin[b.zoneOf(i)] += n
			} else {
				z.peers[b.zoneOf(i)] += n
			}
		}
	}
	return z, nil
}

// ratios returns each zone's bytes from outside it, from the origin and
// from other zones' hosts together and from those hosts alone, since z0,
// per S.
func (z zoneBytes) ratios(z0 zoneBytes, size int64) (in, peers []float64) {
	for k := range z.origin {
		p := z.peers[k] - z0.peers[k]
		in = append(in, benchfig.Round(float64(z.origin[k]-z0.origin[k]+p)/float64(size), 3))
		peers = append(peers, benchfig.Round(float64(p)/float64(size), 3))
	}
	return in, peers
}
