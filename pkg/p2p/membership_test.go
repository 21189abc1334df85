package p2p

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/gossipnet"
	"github.com/weightd/weightd/pkg/content"
)

// Bounds for require.Eventually in the cluster tests: gossip with Fast
// settings converges within a few hundred milliseconds.
const (
	waitFor = 10 * time.Second
	tick    = 10 * time.Millisecond
)

// testNode is a Membership running on 127.0.0.1 in this process.
type testNode struct {
	m      *Membership
	r      *Router
	reg    *prometheus.Registry
	logs   *logRecorder
	cancel context.CancelFunc
	done   chan error
}

// startNode starts a Membership with cfg on 127.0.0.1, a free port and Fast
// timing, and waits until it is ready; prep runs between NewMembership and
// Run. The node is stopped when the test ends.
func startNode(t *testing.T, cfg MembershipConfig, prep ...func(*Membership)) *testNode {
	t.Helper()
	cfg.BindAddr, cfg.Fast = "127.0.0.1", true
	n := &testNode{r: NewRouter(0), reg: prometheus.NewRegistry(), logs: &logRecorder{}, done: make(chan error, 1)}
	cfg.Registerer = n.reg
	cfg.Logger = slog.New(n.logs)
	var err error
	n.m, err = NewMembership(cfg, n.r)
	require.NoError(t, err)
	for _, p := range prep {
		p(n.m)
	}
	var ctx context.Context
	ctx, n.cancel = context.WithCancel(context.Background())
	go func() { n.done <- n.m.Run(ctx) }()
	t.Cleanup(func() { n.stop(t) })
	select {
	case <-n.m.Ready():
	case err := <-n.done:
		require.FailNow(t, "Run failed", "%v", err)
	case <-time.After(waitFor):
		require.FailNow(t, "membership not ready")
	}
	require.NotEmpty(t, n.m.LocalAddr())
	return n
}

// stop cancels Run and requires it to return nil promptly; later calls
// do nothing.
func (n *testNode) stop(t *testing.T) {
	t.Helper()
	n.cancel()
	select {
	case err, ok := <-n.done:
		if ok {
			require.NoError(t, err)
			close(n.done)
		}
	case <-time.After(waitFor):
		require.FailNow(t, "Run did not return after cancel", n.m.LocalName())
	}
}

// startCluster starts n nodes, all joining through the first, and waits
// until each sees all the others.
func startCluster(t *testing.T, n int, cfg func(i int) MembershipConfig) []*testNode {
	t.Helper()
	nodes := []*testNode{startNode(t, cfg(0))}
	for i := 1; i < n; i++ {
		c := cfg(i)
		c.Join = []string{nodes[0].m.LocalAddr()}
		nodes = append(nodes, startNode(t, c))
	}
	waitMembers(t, nodes...)
	return nodes
}

// waitMembers waits until each node sees exactly the others.
func waitMembers(t *testing.T, nodes ...*testNode) {
	t.Helper()
	var names []string
	for _, n := range nodes {
		names = append(names, n.m.LocalName())
	}
	slices.Sort(names)
	for _, n := range nodes {
		want := slices.DeleteFunc(slices.Clone(names), func(s string) bool { return s == n.m.LocalName() })
		require.Eventually(t, func() bool { return slices.Equal(want, memberNames(n.m)) }, waitFor, tick,
			"%s sees %v, want %v", n.m.LocalName(), memberNames(n.m), want)
	}
}

func memberNames(m *Membership) []string {
	var names []string
	for _, p := range m.Members() {
		names = append(names, p.Name)
	}
	return names
}

func nodeName(t *testing.T, i int) string {
	return fmt.Sprintf("%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), i)
}

func testKey(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }

// logRecorder is a slog.Handler keeping the messages logged and their
// attributes.
type logRecorder struct {
	mu      sync.Mutex
	records []string // "msg k=v k=v"
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *logRecorder) WithGroup(string) slog.Handler            { return l }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.records = append(l.records, b.String())
	return nil
}

// mark is where the records logged from now on begin, for foundDead.
func (l *logRecorder) mark() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.records)
}

// foundDead reports whether memberlist logged, after mark, that its
// probes found node dead (its suspicion timed out: "Marking … as failed")
// rather than seeing it leave. A suspicion alone is no such finding: a
// probe in flight as the node leaves goes unanswered, and on a loaded
// machine it times out before the leave is read, which then settles it.
func (l *logRecorder) foundDead(node string, mark int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.records[mark:], func(r string) bool {
		return strings.Contains(r, "Marking "+node+" as failed")
	})
}

// has reports whether any record starts with prefix.
func (l *logRecorder) has(prefix string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.records, func(s string) bool { return strings.HasPrefix(s, prefix) })
}

func TestNewMembershipValidates(t *testing.T) {
	t.Parallel()
	r := NewRouter(0)
	for name, cfg := range map[string]MembershipConfig{
		"long name":          {NodeName: strings.Repeat("n", 256)},
		"bind not an IP":     {NodeName: "a", BindAddr: "localhost"},
		"advertise not IP":   {NodeName: "a", AdvertiseAddr: "example.com"},
		"advertise port":     {NodeName: "a", AdvertisePort: 7946},
		"negative port":      {NodeName: "a", BindPort: -1},
		"port too big":       {NodeName: "a", BindPort: 70000},
		"seed without port":  {NodeName: "a", Join: []string{"10.0.0.1"}},
		"DNS without port":   {NodeName: "a", JoinDNS: "weightd.svc"},
		"DNS with bad port":  {NodeName: "a", JoinDNS: "weightd.svc:x"},
		"key of 10 bytes":    {NodeName: "a", SecretKeys: [][]byte{make([]byte, 10)}},
		"second key invalid": {NodeName: "a", SecretKeys: [][]byte{testKey(1), make([]byte, 31)}},
		"meta too long":      {NodeName: "a", Meta: NodeMeta{Zone: strings.Repeat("z", 64)}},
		"meta bad address":   {NodeName: "a", Meta: NodeMeta{ChunkAddr: "no-port"}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := NewMembership(cfg, r)
			require.ErrorIs(t, err, content.ErrInvalid)
		})
	}
	_, err := NewMembership(MembershipConfig{NodeName: "a"}, nil)
	require.ErrorIs(t, err, content.ErrInvalid)

	m, err := NewMembership(MembershipConfig{}, r)
	require.NoError(t, err)
	host, err := os.Hostname()
	require.NoError(t, err)
	assert.Equal(t, host, m.LocalName())
	assert.Empty(t, m.LocalAddr(), "nothing runs before Run")
	assert.Empty(t, m.Members())

	// Metrics collide on a registry used twice.
	reg := prometheus.NewRegistry()
	_, err = NewMembership(MembershipConfig{NodeName: "a", Registerer: reg}, r)
	require.NoError(t, err)
	_, err = NewMembership(MembershipConfig{NodeName: "b", Registerer: reg}, r)
	require.Error(t, err)
}

func TestSplitJoinDNS(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg        MembershipConfig
		host, port string
	}{
		{MembershipConfig{JoinDNS: "weightd.ns.svc", BindPort: 7946}, "weightd.ns.svc", "7946"},
		{MembershipConfig{JoinDNS: "weightd.ns.svc", BindPort: 7946, AdvertiseAddr: "10.0.0.1", AdvertisePort: 17946}, "weightd.ns.svc", "17946"},
		{MembershipConfig{JoinDNS: "weightd.ns.svc:8000"}, "weightd.ns.svc", "8000"},
	} {
		host, port, err := splitJoinDNS(tc.cfg)
		require.NoError(t, err)
		assert.Equal(t, tc.host, host)
		assert.Equal(t, tc.port, port)
	}
}

func TestClusterConvergesWithMeta(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, 5, func(i int) MembershipConfig {
		return MembershipConfig{
			NodeName: nodeName(t, i),
			Meta:     NodeMeta{ChunkAddr: "127.0.0.1:" + strconv.Itoa(9000+i), Zone: "zone-" + strconv.Itoa(i%2), FreeDisk: int64(i) << 30, Version: "test"},
		}
	})
	for _, n := range nodes {
		for i, other := range nodes {
			if other == n {
				continue
			}
			p, ok := n.m.Peer(other.m.LocalName())
			require.True(t, ok)
			assert.Equal(t, other.m.LocalAddr(), p.GossipAddr)
			assert.Equal(t, NodeMeta{ChunkAddr: "127.0.0.1:" + strconv.Itoa(9000+i), Zone: "zone-" + strconv.Itoa(i%2), FreeDisk: int64(i) << 30, Version: "test"}, p.Meta)
		}
		_, ok := n.m.Peer(n.m.LocalName())
		assert.False(t, ok, "a node is not its own peer")
		assert.InDelta(t, 4, testutil.ToFloat64(n.m.metrics.peers), 0)
	}

	everyPeerSees := func(meta NodeMeta) {
		for _, n := range nodes {
			if n == nodes[2] {
				continue
			}
			require.Eventually(t, func() bool {
				p, ok := n.m.Peer(nodes[2].m.LocalName())
				return ok && reflect.DeepEqual(p.Meta, meta)
			}, waitFor, tick)
		}
	}
	// A metadata change reaches every peer.
	newMeta := NodeMeta{ChunkAddr: "127.0.0.1:9999", Zone: "zone-x", FreeDisk: 12345, Version: "test2"}
	require.NoError(t, nodes[2].m.UpdateMeta(newMeta))
	everyPeerSees(newMeta)
	// So does a count of origin fetches, the rest as it was.
	newMeta.OriginFetches = map[OriginKey]int{OriginKeyOf("hf"): 2}
	require.NoError(t, nodes[2].m.SetOriginFetches(newMeta.OriginFetches))
	everyPeerSees(newMeta)
	// Metadata that would not fit is refused, and the old one kept.
	require.ErrorIs(t, nodes[2].m.UpdateMeta(NodeMeta{Version: strings.Repeat("v", 200)}), content.ErrInvalid)
	p, _ := nodes[0].m.Peer(nodes[2].m.LocalName())
	assert.Equal(t, newMeta, p.Meta)
}

func TestAnnounceReachesEveryRouter(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, 5, func(i int) MembershipConfig {
		return MembershipConfig{NodeName: nodeName(t, i), SecretKeys: [][]byte{testKey(7)}}
	})
	src := nodes[3]
	d := testDigest(1)
	others := slices.DeleteFunc(slices.Clone(nodes), func(n *testNode) bool { return n == src })
	wantHolders := func(want ...string) {
		t.Helper()
		for _, n := range others {
			require.Eventually(t, func() bool { return slices.Equal(want, holderList(n.r.Holders(d))) }, waitFor, tick,
				"%s has holders %v, want %v", n.m.LocalName(), holderList(n.r.Holders(d)), want)
		}
	}

	require.NoError(t, src.m.Announce(EventPartial, d))
	wantHolders(src.m.LocalName() + ":partial")
	require.NoError(t, src.m.Announce(EventComplete, d))
	wantHolders(src.m.LocalName() + ":complete")
	assert.Equal(t, EventComplete, src.r.Local()[d])
	assert.Empty(t, src.r.Holders(d))

	// A second holder sorts after by name, both complete.
	require.NoError(t, nodes[4].m.Announce(EventComplete, d))
	for _, n := range nodes[:3] {
		require.Eventually(t, func() bool { return len(n.r.Holders(d)) == 2 }, waitFor, tick)
	}
	assert.Equal(t, []string{src.m.LocalName() + ":complete", nodes[4].m.LocalName() + ":complete"}, holderList(nodes[0].r.Holders(d)))

	require.NoError(t, nodes[4].m.Announce(EventDropped, d))
	require.NoError(t, src.m.Announce(EventDropped, d))
	wantHolders()
	assert.Empty(t, src.r.Local())

	assert.Positive(t, testutil.ToFloat64(nodes[0].m.metrics.messages.WithLabelValues("complete")))
	assert.Positive(t, testutil.ToFloat64(nodes[0].m.metrics.messages.WithLabelValues("dropped")))

	require.ErrorIs(t, src.m.Announce(EventComplete, "sha256:short"), content.ErrInvalid)
	require.ErrorIs(t, src.m.Announce(0, d), content.ErrInvalid)
}

func TestLeaverForgottenAtOnce(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, 4, func(i int) MembershipConfig { return MembershipConfig{NodeName: nodeName(t, i)} })
	leaver := nodes[1]
	d := testDigest(1)
	require.NoError(t, leaver.m.Announce(EventComplete, d))
	require.NoError(t, nodes[2].m.Announce(EventPartial, d))
	for _, n := range []*testNode{nodes[0], nodes[3]} {
		require.Eventually(t, func() bool { return len(n.r.Holders(d)) == 2 }, waitFor, tick)
	}

	marks := make(map[*testNode]int)
	for _, n := range nodes {
		marks[n] = n.logs.mark()
	}
	leaver.stop(t)
	rest := []*testNode{nodes[0], nodes[2], nodes[3]}
	// The routers' ttl is 30 minutes: only the leave can clear the entries.
	for _, n := range rest {
		require.Eventually(t, func() bool {
			return !slices.Contains(memberNames(n.m), leaver.m.LocalName()) &&
				!slices.ContainsFunc(n.r.Holders(d), func(h Holder) bool { return h.Peer == leaver.m.LocalName() })
		}, 3*time.Second, tick)
		assert.True(t, n.logs.has("peer left peer="+leaver.m.LocalName()+" addr="+leaver.m.LocalAddr()))
		assert.False(t, n.logs.foundDead(leaver.m.LocalName(), marks[n]), "%s found the leaver dead instead of seeing it leave", n.m.LocalName())
		assert.InDelta(t, 2, testutil.ToFloat64(n.m.metrics.peers), 0)
	}
	waitMembers(t, rest...)
	assert.Equal(t, []string{nodes[2].m.LocalName() + ":partial"}, holderList(nodes[0].r.Holders(d)))
	assert.Empty(t, leaver.m.Members(), "a stopped node knows no peers")
}

func TestLateJoinerLearnsHoldingsByPushPull(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, 3, func(i int) MembershipConfig { return MembershipConfig{NodeName: nodeName(t, i)} })
	d1, d2 := testDigest(1), testDigest(2)
	require.NoError(t, nodes[0].m.Announce(EventComplete, d1))
	require.NoError(t, nodes[1].m.Announce(EventPartial, d2))
	require.Eventually(t, func() bool {
		return len(nodes[1].r.Holders(d1)) == 1 && len(nodes[2].r.Holders(d1)) == 1 &&
			len(nodes[0].r.Holders(d2)) == 1 && len(nodes[2].r.Holders(d2)) == 1
	}, waitFor, tick)
	// Let every broadcast run out, so the late joiner can learn only from
	// push/pull, not from an event still being gossiped.
	for _, n := range nodes {
		require.Eventually(t, func() bool { return n.m.broadcasts.NumQueued() == 0 }, waitFor, tick)
	}

	late := startNode(t, MembershipConfig{NodeName: nodeName(t, 3), Join: []string{nodes[2].m.LocalAddr()}})
	waitMembers(t, append(nodes, late)...)
	require.Eventually(t, func() bool {
		return slices.Equal([]string{nodes[0].m.LocalName() + ":complete"}, holderList(late.r.Holders(d1))) &&
			slices.Equal([]string{nodes[1].m.LocalName() + ":partial"}, holderList(late.r.Holders(d2)))
	}, waitFor, tick)
	assert.Positive(t, testutil.ToFloat64(late.m.metrics.messages.WithLabelValues("state")))
}

func TestKeyMismatchCannotJoinOrRead(t *testing.T) {
	t.Parallel()
	for name, keys := range map[string][][]byte{
		"wrong key": {testKey(2)},
		"no key":    nil,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			nodes := startCluster(t, 2, func(i int) MembershipConfig {
				// The cluster also accepts a retired key; the outsider has neither.
				return MembershipConfig{NodeName: nodeName(t, i), SecretKeys: [][]byte{testKey(1), testKey(3)}}
			})
			d := testDigest(1)
			require.NoError(t, nodes[0].m.Announce(EventComplete, d))
			require.Eventually(t, func() bool { return len(nodes[1].r.Holders(d)) == 1 }, waitFor, tick)

			_, port, err := net.SplitHostPort(nodes[0].m.LocalAddr())
			require.NoError(t, err)
			var lookups atomic.Int32
			outsider := startNode(t, MembershipConfig{NodeName: nodeName(t, 9), SecretKeys: keys, JoinDNS: "cluster.test:" + port},
				func(m *Membership) {
					m.lookup = func(context.Context, string) ([]string, error) {
						lookups.Add(1)
						return []string{"127.0.0.1"}, nil
					}
				})
			// Three lookups: at least two join attempts have failed.
			require.Eventually(t, func() bool { return lookups.Load() >= 3 }, waitFor, tick)
			assert.True(t, outsider.logs.has("joining the cluster"), "the failed joins are logged")
			assert.Empty(t, outsider.m.Members())
			assert.Empty(t, outsider.r.Holders(d))
			assert.Equal(t, []string{nodes[1].m.LocalName()}, memberNames(nodes[0].m))
			assert.Equal(t, []string{nodes[0].m.LocalName()}, memberNames(nodes[1].m))

			// Nor can the cluster pull the outsider in: it cannot read the
			// cluster's push/pull.
			nodes[0].m.mu.Lock()
			ml := nodes[0].m.ml
			nodes[0].m.mu.Unlock()
			_, err = ml.Join([]string{outsider.m.LocalAddr()})
			require.Error(t, err)
			assert.Empty(t, outsider.m.Members())
			assert.Empty(t, outsider.r.Holders(d))
			assert.NotContains(t, memberNames(nodes[1].m), outsider.m.LocalName())
		})
	}
}

func TestJoinDNSResolvesOnEveryAttempt(t *testing.T) {
	t.Parallel()
	seed := startNode(t, MembershipConfig{NodeName: nodeName(t, 0)})
	_, port, err := net.SplitHostPort(seed.m.LocalAddr())
	require.NoError(t, err)

	var mu sync.Mutex
	var hosts []string
	joiner := startNode(t, MembershipConfig{NodeName: nodeName(t, 1), JoinDNS: "weightd.test:" + port}, func(m *Membership) {
		m.lookup = func(_ context.Context, host string) ([]string, error) {
			mu.Lock()
			defer mu.Unlock()
			hosts = append(hosts, host)
			switch len(hosts) {
			case 1:
				return nil, errors.New("no such host")
			case 2:
				return nil, nil // the Service has no ready endpoints yet
			}
			return []string{"127.0.0.1"}, nil
		}
	})
	waitMembers(t, seed, joiner)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, hosts, 3, "one lookup per attempt, none once joined")
	for _, h := range hosts {
		assert.Equal(t, "weightd.test", h)
	}
}

func TestDNSSelfOnlyIsNotJoined(t *testing.T) {
	t.Parallel()
	// The first pod of a headless Service finds only itself: it stays alone,
	// without a pointless push/pull with itself, and keeps looking. JoinDNS
	// has no port, so the seeds are on BindPort, which is this node's.
	var lookups atomic.Int32
	n := startNode(t, MembershipConfig{NodeName: nodeName(t, 0), BindPort: freePort(t), JoinDNS: "weightd.test"}, func(m *Membership) {
		m.lookup = func(context.Context, string) ([]string, error) {
			lookups.Add(1)
			return []string{"127.0.0.1"}, nil
		}
	})
	require.Eventually(t, func() bool { return lookups.Load() >= 3 }, waitFor, tick)
	assert.Empty(t, n.m.Members())
	assert.Zero(t, testutil.ToFloat64(n.m.metrics.messages.WithLabelValues("state")), "no push/pull took place")
	assert.True(t, n.logs.has("no other member to join yet"))
	assert.False(t, n.logs.has("joining the cluster"), "no join failed")
}

// freePort returns a port free on 127.0.0.1 for both TCP and UDP, as
// memberlist needs, at the time of the call.
func freePort(t *testing.T) int {
	t.Helper()
	for range 10 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		require.NoError(t, l.Close())
		if err == nil {
			require.NoError(t, u.Close())
			return port
		}
	}
	require.FailNow(t, "no free port")
	return 0
}

func TestRunStopsAndLeavesOnCancel(t *testing.T) {
	t.Parallel()
	nodes := startCluster(t, 2, func(i int) MembershipConfig { return MembershipConfig{NodeName: nodeName(t, i)} })
	mark := nodes[0].logs.mark()
	start := time.Now()
	nodes[1].stop(t)
	assert.Less(t, time.Since(start), 3*time.Second)
	require.Eventually(t, func() bool { return len(nodes[0].m.Members()) == 0 }, 3*time.Second, tick)
	assert.True(t, nodes[0].logs.has("peer left peer="+nodes[1].m.LocalName()), "the leave was seen")
	// A node that stopped without leaving would have been suspected, then
	// marked failed, before it was dropped.
	assert.False(t, nodes[0].logs.foundDead(nodes[1].m.LocalName(), mark), "the node was found dead instead of seen leaving")
	assert.True(t, nodes[1].logs.has("left the cluster"))

	// Run runs once.
	require.ErrorContains(t, nodes[1].m.Run(context.Background()), "twice")
	// Meta updates after the end are accepted and go nowhere.
	require.NoError(t, nodes[1].m.UpdateMeta(NodeMeta{Version: "late"}))
}

func TestRunFailsToBind(t *testing.T) {
	t.Parallel()
	taken := startNode(t, MembershipConfig{NodeName: nodeName(t, 0)})
	_, port, err := net.SplitHostPort(taken.m.LocalAddr())
	require.NoError(t, err)
	p, err := strconv.Atoi(port)
	require.NoError(t, err)
	m, err := NewMembership(MembershipConfig{NodeName: nodeName(t, 1), BindAddr: "127.0.0.1", BindPort: p, Fast: true}, NewRouter(0))
	require.NoError(t, err)
	require.ErrorContains(t, m.Run(context.Background()), "starting gossip on 127.0.0.1:"+port)
	select {
	case <-m.Ready():
		t.Fatal("Ready closed though gossip never started")
	default:
	}
}

func TestDelegatesCopyAndCount(t *testing.T) {
	t.Parallel()
	n := startNode(t, MembershipConfig{NodeName: nodeName(t, 0)})
	dlg := (*membershipDelegate)(n.m)
	d := testDigest(5)
	// Claims about a node that is no member are dropped, and not relayed.
	ghost, err := encodeEvent(holdingEvent{Node: "peer", holding: holding{Kind: EventComplete, Seq: 1, Digest: d}})
	require.NoError(t, err)
	ghostState, err := encodeState(holdingState{Node: "other", Clock: 2, Holdings: []holding{{Kind: EventPartial, Seq: 2, Digest: d}}}, maxStateSize)
	require.NoError(t, err)
	dropped := testutil.ToFloat64(n.m.metrics.dropped)
	dlg.NotifyMsg(ghost)
	dlg.MergeRemoteState(ghostState, false)
	assert.Empty(t, n.r.Holders(d))
	assert.Zero(t, n.m.broadcasts.NumQueued())
	assert.InDelta(t, dropped+2, testutil.ToFloat64(n.m.metrics.dropped), 0)
	for _, name := range []string{"peer", "other"} {
		(*membershipEvents)(n.m).NotifyJoin(&memberlist.Node{Name: name, Addr: net.IPv4(127, 0, 0, 1), Port: 1})
	}

	msg, err := encodeEvent(holdingEvent{Node: "peer", holding: holding{Kind: EventComplete, Seq: 1, Digest: d}})
	require.NoError(t, err)
	want := bytes.Clone(msg)
	dlg.NotifyMsg(msg)
	clear(msg) // memberlist reuses its buffers
	assert.Equal(t, []string{"peer:complete"}, holderList(n.r.Holders(d)))
	// The news is queued for relay, intact.
	relayed := dlg.GetBroadcasts(0, 1400)
	require.Len(t, relayed, 1)
	assert.Equal(t, want, relayed[0])
	// A repeat is not relayed again.
	n.m.broadcasts.Reset()
	dlg.NotifyMsg(want)
	assert.Zero(t, n.m.broadcasts.NumQueued())
	// Events about this node itself are not applied to its router.
	self, err := encodeEvent(holdingEvent{Node: n.m.LocalName(), holding: holding{Kind: EventComplete, Seq: 1, Digest: d}})
	require.NoError(t, err)
	dlg.NotifyMsg(self)
	assert.Equal(t, []string{"peer:complete"}, holderList(n.r.Holders(d)))

	st, err := encodeState(holdingState{Node: "other", Clock: 2, Holdings: []holding{{Kind: EventPartial, Seq: 2, Digest: d}}}, maxStateSize)
	require.NoError(t, err)
	dlg.MergeRemoteState(st, false)
	clear(st)
	assert.Equal(t, []string{"peer:complete", "other:partial"}, holderList(n.r.Holders(d)))

	dropped = testutil.ToFloat64(n.m.metrics.dropped)
	dlg.NotifyMsg([]byte{eventVersion, 0xff})
	dlg.MergeRemoteState([]byte("garbage"), true)
	assert.InDelta(t, dropped+2, testutil.ToFloat64(n.m.metrics.dropped), 0)

	// The local state is this node's holdings.
	require.NoError(t, n.m.Announce(EventComplete, testDigest(6)))
	got, err := decodeState(dlg.LocalState(false))
	require.NoError(t, err)
	assert.Equal(t, n.m.LocalName(), got.Node)
	require.Len(t, got.Holdings, 1)
	assert.Equal(t, testDigest(6), got.Holdings[0].Digest)

	meta := dlg.NodeMeta(512)
	decoded, err := decodeMeta(meta)
	require.NoError(t, err)
	assert.Equal(t, NodeMeta{}, decoded)
	assert.Nil(t, dlg.NodeMeta(1), "never more than the limit")

	// The metrics are on the registry given.
	names := map[string]bool{}
	mfs, err := n.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	assert.Equal(t, map[string]bool{"weightd_p2p_peers": true, "weightd_p2p_gossip_messages_total": true, "weightd_p2p_gossip_dropped_total": true}, names)
}

func TestBroadcastQueueBounded(t *testing.T) {
	t.Parallel()
	m, err := NewMembership(MembershipConfig{NodeName: "a"}, NewRouter(0))
	require.NoError(t, err)
	// A newer event about the same blob replaces the queued one.
	require.NoError(t, m.Announce(EventPartial, testDigest(0)))
	require.NoError(t, m.Announce(EventComplete, testDigest(0)))
	require.Equal(t, 1, m.broadcasts.NumQueued())
	got, err := decodeEvent(m.broadcasts.GetBroadcasts(0, 1400)[0])
	require.NoError(t, err)
	assert.Equal(t, EventComplete, got.Kind)

	for i := range maxQueuedBroadcasts + 10 {
		require.NoError(t, m.Announce(EventComplete, testDigest(i+1)))
	}
	assert.Equal(t, maxQueuedBroadcasts, m.broadcasts.NumQueued())
	assert.InDelta(t, 11, testutil.ToFloat64(m.metrics.dropped), 0)
}

func TestMemberlistLogAtDebug(t *testing.T) {
	t.Parallel()
	logs := &logRecorder{}
	w := memberlistLogWriter{slog.New(logs)}
	_, err := w.Write([]byte("[WARN] memberlist: something odd\n"))
	require.NoError(t, err)
	_, err = w.Write([]byte("no level here"))
	require.NoError(t, err)
	assert.Equal(t, []string{"memberlist: something odd memberlist_level=WARN", "no level here memberlist_level=INFO"}, logs.records)

	// Silent by default: nothing is formatted for a discarding logger.
	n, err := memberlistLogWriter{slog.New(slog.DiscardHandler)}.Write([]byte("[ERR] x"))
	require.NoError(t, err)
	assert.Equal(t, 7, n)
}

// TestClusterOverMockTransport runs gossip over memberlist's in-process
// transports (gossipnet): the members find each other at the mock
// addresses, which no socket could have, and an announcement reaches them all.
func TestClusterOverMockTransport(t *testing.T) {
	t.Parallel()
	var network gossipnet.Network
	transports := make([]*gossipnet.Transport, 4)
	for i := range transports { // all before any is used
		transports[i] = network.NewTransport(nodeName(t, i))
	}
	nodes := startCluster(t, len(transports), func(i int) MembershipConfig {
		return MembershipConfig{NodeName: nodeName(t, i), Transport: transports[i], SecretKeys: [][]byte{testKey(3)}}
	})
	for i, n := range nodes {
		ip, port, err := transports[i].FinalAdvertiseAddr("", 0)
		require.NoError(t, err)
		require.Equal(t, net.JoinHostPort(ip.String(), strconv.Itoa(port)), n.m.LocalAddr())
	}
	d := testDigest(9)
	require.NoError(t, nodes[2].m.Announce(EventComplete, d))
	for _, n := range []*testNode{nodes[0], nodes[1], nodes[3]} {
		require.Eventually(t, func() bool {
			return slices.Equal([]string{nodes[2].m.LocalName() + ":complete"}, holderList(n.r.Holders(d)))
		},
			waitFor, tick, "%s", n.m.LocalName())
	}
	sent := network.Sent()
	assert.Positive(t, sent.Packets)
	assert.Greater(t, sent.PacketBytes, sent.Packets)
	assert.Positive(t, sent.StreamBytes) // the joins' push/pulls
}

// Members with the same view agree on the first k for a key, whoever
// asks; alone a node is first; when one of the first leaves, the next
// moves in and the others stay.
func TestAmongFirstAgrees(t *testing.T) {
	t.Parallel()
	names := []string{"n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"}
	views := map[string]*Membership{}
	for _, name := range names {
		m, err := NewMembership(MembershipConfig{NodeName: name}, NewRouter(0))
		require.NoError(t, err)
		require.True(t, m.AmongFirst("lease", 3), "alone, %s is first", name)
		views[name] = m
	}
	join := func(m *Membership, name string) {
		m.setPeer(&memberlist.Node{Name: name, Addr: net.IPv4(127, 0, 0, 1), Port: 1})
	}
	for _, m := range views {
		for _, name := range names {
			if name != m.LocalName() {
				join(m, name)
			}
		}
	}
	first := func(key string, k int) []string {
		var in []string
		for _, name := range names {
			if views[name].AmongFirst(key, k) {
				in = append(in, name)
			}
		}
		return in
	}
	three := first("lease", 3)
	require.Len(t, three, 3)
	require.NotEqual(t, three, first("another lease", 3), "another key, other nodes (for these names)")
	require.Len(t, first("lease", 20), len(names), "k beyond the members: every one")

	// The first leaves: the other two stay, one more moves in.
	gone := three[0]
	for name, m := range views {
		if name != gone {
			m.mu.Lock()
			delete(m.peers, gone)
			m.mu.Unlock()
		}
	}
	delete(views, gone)
	names = slices.DeleteFunc(names, func(n string) bool { return n == gone })
	after := first("lease", 3)
	require.Len(t, after, 3)
	require.Subset(t, after, three[1:])
}

// SetOriginFetches changes that field of the node's metadata alone, and
// UpdateMeta, which the agent calls with the other fields, keeps it.
func TestSetOriginFetchesKeepsTheRest(t *testing.T) {
	t.Parallel()
	m, err := NewMembership(MembershipConfig{NodeName: "a", Meta: NodeMeta{ChunkAddr: "10.0.0.1:1", Zone: "z"}}, NewRouter(0))
	require.NoError(t, err)
	local := func() NodeMeta {
		meta, err := decodeMeta((*membershipDelegate)(m).NodeMeta(512))
		require.NoError(t, err)
		return meta
	}
	three := map[OriginKey]int{OriginKeyOf("hf"): 3}
	require.NoError(t, m.SetOriginFetches(three))
	assert.Equal(t, NodeMeta{ChunkAddr: "10.0.0.1:1", Zone: "z", OriginFetches: three}, local())
	require.NoError(t, m.UpdateMeta(NodeMeta{ChunkAddr: "10.0.0.2:1", Version: "v"}))
	assert.Equal(t, NodeMeta{ChunkAddr: "10.0.0.2:1", Version: "v", OriginFetches: three}, local())
	require.Error(t, m.SetOriginFetches(map[OriginKey]int{OriginKeyOf("hf"): -1}))
	require.Error(t, m.SetOriginFetches(tooManyOrigins))
	assert.Equal(t, three, local().OriginFetches, "a bad count changes nothing")
}
