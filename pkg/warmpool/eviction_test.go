package warmpool

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/weightd/weightd/internal/loratest"
)

func TestEvictsFirst(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	older, newer := t0, t0.Add(time.Second)
	for _, tc := range []struct {
		name   string
		policy string
		a, b   candidate
		want   bool
	}{
		{"lfu: fewer uses first, however recent", EvictLFU, candidate{"a", 1, newer}, candidate{"b", 5, older}, true},
		{"lfu: more uses last, however old", EvictLFU, candidate{"a", 5, older}, candidate{"b", 1, newer}, false},
		{"lfu: equal uses, least recently used first", EvictLFU, candidate{"a", 3, older}, candidate{"b", 3, newer}, true},
		{"lfu: equal uses, most recently used last", EvictLFU, candidate{"a", 3, newer}, candidate{"b", 3, older}, false},
		{"lfu: no history counts as no use", EvictLFU, candidate{"a", 0, newer}, candidate{"b", 1, older}, true},
		{"lru: least recently used first, whatever its uses", EvictLRU, candidate{"a", 9, older}, candidate{"b", 1, newer}, true},
		{"lru: most recently used last", EvictLRU, candidate{"a", 1, newer}, candidate{"b", 9, older}, false},
		{"all equal: by name", EvictLFU, candidate{"a", 2, older}, candidate{"b", 2, older}, true},
		{"all equal: by name, reversed", EvictLRU, candidate{"b", 2, older}, candidate{"a", 2, older}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := evictsFirst(tc.policy, tc.a, tc.b); got != tc.want {
				t.Fatalf("evictsFirst(%s, %+v, %+v) = %v, want %v", tc.policy, tc.a, tc.b, got, tc.want)
			}
		})
	}
}

// usesOf spells a sequence of uses: "old*3 new" is old, old, old, new.
func usesOf(spec string) []string {
	var seq []string
	for _, f := range strings.Fields(spec) {
		name, count, repeated := strings.Cut(f, "*")
		n := 1
		if repeated {
			n, _ = strconv.Atoi(count)
		}
		for range n {
			seq = append(seq, name)
		}
	}
	return seq
}

func TestHistoryAging(t *testing.T) {
	for _, tc := range []struct {
		name   string
		window int
		uses   string
		want   map[string]int
	}{
		{"counts within the window", 4, "a a b", map[string]int{"a": 2, "b": 1}},
		{"halves every count at the window, forgetting single uses", 4, "a a a b", map[string]int{"a": 1}},
		{"keeps counting after a halving", 4, "a*4 a b", map[string]int{"a": 3, "b": 1}},
		// old: 4→2 at 4, 6→3 at 8, 3→1 at 12, 1→0 at 16; new: 4→2, 6→3.
		{"a formerly hot adapter fades", 4, "old*8 new*8", map[string]int{"new": 3}},
		// old: 10→5, 15→7, 17→8; new has 8 uses of the window, not yet more.
		{"a newly hot adapter needs more recent uses than the old one kept", 10, "old*30 new*8", map[string]int{"old": 8, "new": 8}},
		{"then has them", 10, "old*30 new*9", map[string]int{"old": 8, "new": 9}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h history
			for _, n := range usesOf(tc.uses) {
				h.add(n, tc.window)
			}
			if !maps.Equal(h.counts, tc.want) {
				t.Fatalf("after %q: counts %v, want %v", tc.uses, h.counts, tc.want)
			}
		})
	}
}

// A formerly hot adapter is protected against a newcomer used once, then
// loses to one used more often since, under the policy itself.
func TestLFUAgingLetsANewlyHotAdapterWin(t *testing.T) {
	var h history
	for _, n := range usesOf("old*30") {
		h.add(n, 10)
	}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	oldC := candidate{name: "old", uses: h.counts["old"], lastUsed: t0}
	for i := 1; ; i++ {
		h.add("new", 10)
		newC := candidate{name: "new", uses: h.counts["new"], lastUsed: t0.Add(time.Duration(i) * time.Second)}
		oldC.uses = h.counts["old"]
		if evictsFirst(EvictLFU, oldC, newC) {
			if i == 1 {
				t.Fatal("the old adapter went first after one use of the new one")
			}
			return
		}
		if i > 20 {
			t.Fatalf("after %d uses of new (%d) the old one (%d) still goes last", i, newC.uses, oldC.uses)
		}
	}
}

// With every slot taken, the default policy evicts the adapter of the
// fewest recent uses where LRU evicts the least recently used; an evicted
// adapter keeps its count.
func TestEvictionPolicies(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		policy string
		// uses is the sequence of ensures; want the adapters loaded after.
		uses string
		want []string
	}{
		{EvictLFU, "hot*3 b c", []string{"c", "hot"}},
		{EvictLRU, "hot*3 b c", []string{"b", "c"}},
		{"", "hot*3 b c", []string{"c", "hot"}},
		// b, evicted by c, comes back with 2 uses, evicts c (1) and then
		// goes for d, not hot (4); LRU evicts hot for b, then c for d.
		{EvictLFU, "hot*3 b hot c b d", []string{"d", "hot"}},
		{EvictLRU, "hot*3 b hot c b d", []string{"b", "d"}},
	} {
		t.Run(tc.policy+": "+tc.uses, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, serverOpts{slots: 2})
			f.cfg.Eviction = tc.policy
			f.pool = f.newPool()
			refs := map[string]string{}
			for _, n := range usesOf(tc.uses) {
				if refs[n] == "" {
					refs[n] = f.adapter(n, loratest.AdapterSpec{})
				}
				f.mustEnsure("", refs[n], n)
			}
			if got := f.loaded(0); !slices.Equal(got, tc.want) {
				t.Fatalf("loaded %v, want %v", got, tc.want)
			}
		})
	}
}

func TestNewRejectsAnUnknownEviction(t *testing.T) {
	f := newFixture(t)
	cfg := f.cfg
	cfg.Eviction = "fifo"
	if _, err := New(cfg); err == nil {
		t.Fatal("New took eviction fifo")
	}
}
