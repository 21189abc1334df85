package p2p

import (
	"slices"
	"testing"

	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"
)

// Whatever mix of asks reaches an origin fetcher for one chunk (members
// and strangers, claims that the receiver failed or none), the first
// member to ask is its receiver, it goes again at most maxSendsAgain
// times in its window, each time to a member other than the last
// receiver, and no stranger opens, takes or moves the window.
func FuzzSentLogOnce(f *testing.F) {
	f.Add([]byte{0x01, 0x12, 0x13, 0x14, 0x12, 0x13})
	f.Add([]byte{0x09, 0x19, 0x02, 0x12, 0x1a})
	f.Add([]byte{0x12, 0x12, 0x13, 0x13})
	f.Fuzz(func(t *testing.T, asks []byte) {
		var l sentLog
		d := digest.FromString("blob")
		hosts := []string{"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"}
		member := func(host string) bool { return slices.Contains(hosts, host) }
		receiver, agains := "", 0
		for _, b := range asks {
			// Low bits: the host; 0x08: a stranger; 0x10: a claim.
			a := chunkAsk{once: true, from: hosts[b&3], again: b&0x10 != 0, member: member}
			stranger := b&8 != 0
			if stranger {
				a.from = "192.0.2." + hosts[b&3][len("10.0.0."):]
			}
			ok, to := l.mark(d, 0, a)
			switch {
			case receiver == "" && stranger:
				require.True(t, ok, "no window yet: a stranger is served")
			case receiver == "":
				require.True(t, ok)
				receiver = a.from
			case !ok:
				require.Equal(t, receiver, to, "a refusal names the receiver")
			default:
				require.True(t, a.again && !stranger && a.from != receiver, "sent again only on a member's claim, not the receiver's")
				agains++
				require.LessOrEqual(t, agains, maxSendsAgain)
				receiver = a.from
			}
		}
	})
}
