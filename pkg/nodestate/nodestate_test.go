package nodestate

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// labelNameRE is the Kubernetes label name grammar (the part after the prefix).
var labelNameRE = regexp.MustCompile(`^[a-z0-9A-Z]([-a-z0-9A-Z_.]{0,61}[a-z0-9A-Z])?$`)

func TestKey(t *testing.T) {
	t.Parallel()
	tests := []struct{ ref, prefix string }{
		{"hf://meta-llama/Llama-3.1-8B-Instruct@main", "llama-3.1-8b-instruct-"},
		{"oci://ghcr.io/org/vllm-openai:v0.11.0", "vllm-openai-"},
		{"oci://ghcr.io/org/app@sha256:" + strings.Repeat("a", 64), "app-"},
		{"https://host/m/model.json?X-Amz-Signature=x", "model.json-"},
		{"hf://gpt2@" + strings.Repeat("0a", 20), "gpt2-"},
		{"https://host/" + strings.Repeat("x", 200) + "/f.bin", "f.bin-"},
		{"hf://org/" + strings.Repeat("a", 96) + "@main", strings.Repeat("a", 40) + "-"},
		{"oci://h/___:t", "m-"},
	}
	for _, tt := range tests {
		k := Key(tt.ref)
		assert.True(t, strings.HasPrefix(k, tt.prefix), "%s: %s", tt.ref, k)
		assert.Regexp(t, labelNameRE, k, tt.ref)
		assert.Equal(t, k, Key(tt.ref), "stable")
		assert.Equal(t, LabelPrefix+k, Label(tt.ref))
	}
	assert.NotEqual(t, Key("hf://org/model@main"), Key("hf://org/model@v2"), "the hash tells revisions apart")
}

func FuzzKey(f *testing.F) {
	for _, s := range []string{"hf://org/name@main", "oci://r/x:y", "https://h/a b", "", "://", "@@@", "ÄÖÜ"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ref string) {
		k := Key(ref)
		if !labelNameRE.MatchString(k) {
			t.Fatalf("Key(%q) = %q is not a label name", ref, k)
		}
	})
}

func TestSummaryRoundTripAndBound(t *testing.T) {
	t.Parallel()
	s := Summary{Entries: []Entry{
		{Key: Key("hf://org/m@main"), Ref: "hf://org/m@main", State: StateReady, Bytes: 10, Total: 10},
		{Key: Key("oci://r/app:v1"), Ref: "oci://r/app:v1", State: StateFetching, Bytes: 3, Total: 10, Image: true},
	}}
	enc, err := s.Encode()
	require.NoError(t, err)
	got, err := Decode(enc)
	require.NoError(t, err)
	assert.Equal(t, 1, got.V)
	assert.Equal(t, s.Entries, got.Entries)
	e, ok := got.Find(Key("oci://r/app:v1"))
	require.True(t, ok)
	assert.True(t, e.Image)

	// 10,000 models do not make an annotation over the bound.
	var many Summary
	for i := range 10_000 {
		ref := fmt.Sprintf("hf://org/model-%d@main", i)
		many.Entries = append(many.Entries, Entry{Key: Key(ref), Ref: ref, State: StateReady, Bytes: 1 << 40, Total: 1 << 40})
	}
	enc, err = many.Encode()
	require.NoError(t, err)
	assert.LessOrEqual(t, len(enc), MaxSummaryBytes)
	got, err = Decode(enc)
	require.NoError(t, err)
	assert.Equal(t, 10_000, len(got.Entries)+got.Truncated)
	assert.Equal(t, many.Entries[0], got.Entries[0], "the first entries are kept")
	assert.Greater(t, len(got.Entries), 100)
}

func TestDecodeRejects(t *testing.T) {
	t.Parallel()
	for _, s := range []string{
		"", "{", `{"v":2,"entries":[]}`, `{"v":1,"entries":[{"bytes":-1}]}`,
		`{"v":1,"entries":[{"bytes":5,"total":4}]}`, strings.Repeat(" ", MaxSummaryBytes+1),
	} {
		_, err := Decode(s)
		assert.Error(t, err, "%.40q", s)
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(`{"v":1,"entries":[{"key":"a-1","ref":"hf://a@b","state":"ready","bytes":1,"total":2}]}`)
	f.Add(`{"v":1,"entries":null,"truncated":3}`)
	f.Fuzz(func(t *testing.T, s string) {
		sum, err := Decode(s)
		if err != nil {
			return
		}
		if _, err := sum.Encode(); err != nil {
			t.Fatalf("a decoded summary does not encode: %v", err)
		}
	})
}
