package nodestate

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWarmLabel(t *testing.T) {
	t.Parallel()
	ref := "hf://Qwen/Qwen2.5-7B-Instruct@main"
	assert.Equal(t, "warm.weightd.io/"+Key(ref), WarmLabel(ref))
	assert.LessOrEqual(t, len(Key(ref)), 63, "a label name")
}

func TestAdapters(t *testing.T) {
	t.Parallel()
	assert.Equal(t, "[]", EncodeAdapters(nil))
	assert.Equal(t, `["a","b/c:1"]`, EncodeAdapters([]string{"b/c:1", "a", "a"}))
	names, err := DecodeAdapters(`["a","b/c:1"]`)
	require.NoError(t, err)
	assert.Equal(t, []string{"a", "b/c:1"}, names)
	names, err = DecodeAdapters("[]")
	require.NoError(t, err)
	assert.Empty(t, names)

	// Too many to fit: the last names in order are left out.
	many := make([]string, 1000)
	for i := range many {
		many[i] = fmt.Sprintf("adapter-%04d-%s", i, strings.Repeat("x", 20))
	}
	enc := EncodeAdapters(many)
	assert.LessOrEqual(t, len(enc), MaxAdaptersBytes)
	names, err = DecodeAdapters(enc)
	require.NoError(t, err)
	assert.Greater(t, len(names), 400)
	assert.Equal(t, many[:len(names)], names)

	for _, bad := range []string{"", "null", "{}", `["a",1]`, "[" + strings.Repeat(`"a",`, MaxAdaptersBytes/4) + `"a"]`} {
		_, err := DecodeAdapters(bad)
		assert.Error(t, err, bad)
	}
}

func FuzzDecodeAdapters(f *testing.F) {
	f.Add(`["a","b"]`)
	f.Add(`[]`)
	f.Add(`null`)
	f.Fuzz(func(t *testing.T, s string) {
		names, err := DecodeAdapters(s)
		if err != nil {
			return
		}
		again, err := DecodeAdapters(EncodeAdapters(names))
		if err != nil || len(again) > len(names) {
			t.Fatalf("%q: re-encoded %q: %v", s, again, err)
		}
	})
}
