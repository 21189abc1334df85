package dialguard

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"syscall"

	"github.com/weightd/weightd/pkg/content"
)

// ErrAddressRefused is a Guard's refusal to connect to an address a
// reference may not make the agent reach. Errors wrapping it also wrap
// content.ErrPermanent: retrying cannot make the address acceptable.
var ErrAddressRefused = errors.New("address refused")

// metadataAddrs are cloud metadata services outside the link-local range:
// AWS's IPv6 endpoint (in the private fd00::/8) and Alibaba Cloud's (in the
// shared 100.64.0.0/10), both answering with the node's credentials.
var metadataAddrs = []netip.Addr{
	netip.MustParseAddr("fd00:ec2::254"),
	netip.MustParseAddr("100.100.100.200"),
}

// thisNetwork is 0.0.0.0/8: Linux connects 0.0.0.0 to the host itself.
var thisNetwork = netip.MustParsePrefix("0.0.0.0/8")

// Guard refuses outgoing connections to the addresses a reference named
// by a pod must not make the agent reach from the node's network: loopback,
// link-local (169.254.0.0/16 with the cloud metadata service, fe80::/10),
// unspecified, the known cloud metadata addresses and every address of the
// node's own interfaces (its kubelet, containerd and weightd's own API
// listen there). Private ranges (RFC 1918, fc00::/7) are allowed: in-cluster
// model stores and registries live on pod and Service addresses, which pods
// reach anyway.
//
// The check runs at connect time on the address actually dialled (a
// net.Dialer Control function), so a host name resolving to a refused
// address, a DNS answer that changes between checks, and redirects are all
// covered. Addresses in the allowlist are always accepted, and so are
// connections to the trusted host:port pairs, named by the operator (the
// hub endpoint, the mirrored registries) rather than by a pod.
//
// A proxy from the environment (HTTPS_PROXY) is dialled and checked in
// place of the origin: the origin behind it is the proxy's to restrict.
type Guard struct {
	allow   []netip.Prefix
	trusted map[string]bool
	dialer  net.Dialer // with Control set to check
	plain   net.Dialer // for trusted host:port pairs
	// localAddrs lists the node's own addresses; it is read at each dial,
	// since interfaces come and go.
	localAddrs func() ([]net.Addr, error)
}

// New returns a guard that accepts the addresses in allow besides
// those it accepts by default, and any connection to one of trusted
// ("host:port", or "host", meaning ports 80 and 443), named by the operator.
func New(allow []netip.Prefix, trusted ...string) *Guard {
	g := &Guard{allow: allow, trusted: make(map[string]bool), localAddrs: net.InterfaceAddrs}
	for _, hp := range trusted {
		hp = strings.ToLower(hp)
		if _, _, err := net.SplitHostPort(hp); err == nil {
			g.trusted[hp] = true
			continue
		}
		host := strings.TrimSuffix(strings.TrimPrefix(hp, "["), "]")
		g.trusted[net.JoinHostPort(host, "80")] = true
		g.trusted[net.JoinHostPort(host, "443")] = true
	}
	g.dialer.Control = g.control
	return g
}

// ParseAllowList parses CIDRs ("10.0.0.0/8", "fd00::/8") and single
// addresses ("192.0.2.7", a /32 or /128) for New.
func ParseAllowList(cidrs []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(cidrs))
	for _, s := range cidrs {
		s = strings.TrimSpace(s)
		if !strings.Contains(s, "/") {
			a, err := netip.ParseAddr(s)
			if err != nil {
				return nil, fmt.Errorf("%q is neither a CIDR nor an IP address", s)
			}
			out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("%q is not a CIDR: %w", s, err)
		}
		if p.Addr().Is4In6() {
			return nil, fmt.Errorf("%q: write IPv4 CIDRs as IPv4", s)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// Transport is http.DefaultTransport's settings with every connection
// dialled through the guard, and idle connections kept for as many
// parallel reads of one origin as a node makes (the default keeps two, so
// the swarm's ranged GETs would each dial anew: a handshake and slow start
// per chunk, on a link that is full).
func (g *Guard) Transport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = g.DialContext
	t.MaxIdleConnsPerHost = idlePerOrigin
	t.MaxIdleConns = 4 * idlePerOrigin
	return t
}

// idlePerOrigin is the idle connections kept to one origin host.
const idlePerOrigin = 64

// DialContext dials address, checking the address it connects to unless
// address is one of the trusted host:port pairs.
func (g *Guard) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	if g.trusted[strings.ToLower(address)] {
		return g.plain.DialContext(ctx, network, address)
	}
	return g.dialer.DialContext(ctx, network, address)
}

// control is the dialer's Control function: it sees the resolved address
// just before the connect.
func (g *Guard) control(_, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return content.Permanent(fmt.Errorf("%w: cannot check %q: %v", ErrAddressRefused, address, err))
	}
	return g.Check(ap.Addr())
}

// Check returns nil when a connection to ip is acceptable, or an error
// wrapping ErrAddressRefused (and content.ErrPermanent) that says why not.
func (g *Guard) Check(ip netip.Addr) error {
	ip = ip.Unmap().WithZone("")
	for _, p := range g.allow {
		if p.Contains(ip) {
			return nil
		}
	}
	why := ""
	switch {
	case ip.IsLoopback():
		why = "a loopback address"
	case ip.IsLinkLocalUnicast():
		why = "a link-local address (where cloud metadata services answer)"
	case ip.IsUnspecified() || thisNetwork.Contains(ip):
		why = "an unspecified address (the node itself)"
	case ip.IsMulticast():
		why = "a multicast address"
	default:
		for _, m := range metadataAddrs {
			if ip == m {
				why = "a cloud metadata service's address"
			}
		}
	}
	if why == "" {
		local, err := g.localAddrs()
		if err != nil {
			return content.Permanent(fmt.Errorf("%w: %s: listing the node's own addresses to compare: %v", ErrAddressRefused, ip, err))
		}
		for _, a := range local {
			if n, ok := a.(*net.IPNet); ok {
				if la, ok := netip.AddrFromSlice(n.IP); ok && la.Unmap() == ip {
					why = "one of the node's own addresses"
				}
			}
		}
	}
	if why == "" {
		return nil
	}
	return content.Permanent(fmt.Errorf("%w: %s is %s, which a reference may not make the agent reach; the operator's fetch allowlist (--fetch-allow-cidrs) can allow it", ErrAddressRefused, ip, why))
}
