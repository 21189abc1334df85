package podrequest

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

func warmAnnotations() map[string]string {
	return map[string]string{
		WarmBase:    " hf://Qwen/Qwen2.5-7B-Instruct@main ",
		WarmRuntime: "vllm",
		WarmPort:    "8000",
		WarmSlots:   " 4",
		WarmMaxRank: "64",
	}
}

func TestParseWarmServer(t *testing.T) {
	t.Parallel()
	assert.True(t, IsWarmServer(map[string]string{WarmServerLabel: "true"}))
	assert.False(t, IsWarmServer(map[string]string{WarmServerLabel: "false"}))
	assert.False(t, IsWarmServer(nil))

	s, err := ParseWarmServer(warmAnnotations())
	require.NoError(t, err)
	assert.Equal(t, "hf://Qwen/Qwen2.5-7B-Instruct@main", s.Base.String())
	assert.Equal(t, WarmServer{Base: s.Base, Runtime: engine.VLLM, Port: 8000, Slots: 4, MaxRank: 64}, s)

	a := warmAnnotations()
	delete(a, WarmMaxRank)
	a[WarmRuntime] = "sglang"
	s, err = ParseWarmServer(a)
	require.NoError(t, err)
	assert.Equal(t, engine.SGLang, s.Runtime)
	assert.Zero(t, s.MaxRank, "unknown")
}

func TestParseWarmServerRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, key, value, want string
	}{
		{"no base", WarmBase, "", "annotation weightd.io/base is missing"},
		{"bad base", WarmBase, "ftp://host/model", "annotation weightd.io/base"},
		{"no runtime", WarmRuntime, "", "annotation weightd.io/runtime is missing"},
		{"unknown runtime", WarmRuntime, "tgi", `"tgi" is not vllm or sglang`},
		{"no port", WarmPort, "", "annotation weightd.io/port is missing"},
		{"port zero", WarmPort, "0", "not a number from 1 to 65535"},
		{"port too big", WarmPort, "65536", "not a number from 1 to 65535"},
		{"port sign", WarmPort, "+80", "not a number"},
		{"port empty", WarmPort, " ", "not a number"},
		{"port huge", WarmPort, strings.Repeat("9", 40), "not a number"},
		{"slots", WarmSlots, "many", "annotation weightd.io/adapter-slots"},
		{"too many slots", WarmSlots, "257", "from 1 to 256"},
		{"rank", WarmMaxRank, "-8", "annotation weightd.io/max-lora-rank"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			a := warmAnnotations()
			if tt.value == "" {
				delete(a, tt.key)
			} else {
				a[tt.key] = tt.value
			}
			_, err := ParseWarmServer(a)
			require.Error(t, err)
			assert.True(t, invalid(err), "%v", err)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

func TestParseAdapterRequest(t *testing.T) {
	t.Parallel()
	_, ok, err := ParseAdapterRequest(map[string]string{Models: "hf://org/m"})
	require.NoError(t, err)
	assert.False(t, ok, "asks for no adapter")

	r, ok, err := ParseAdapterRequest(map[string]string{
		LoraBase: "hf://Qwen/Qwen2.5-7B-Instruct@main", LoraAdapter: " hf://org/adapter@v3", LoraName: "org_adapter.v3",
	})
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, "hf://Qwen/Qwen2.5-7B-Instruct@main", r.Base.String())
	assert.Equal(t, "hf://org/adapter@v3", r.Adapter.String())
	assert.Equal(t, "org_adapter.v3", r.Name)

	r, _, err = ParseAdapterRequest(map[string]string{LoraBase: "hf://org/base", LoraAdapter: "oci://r.io/a:1"})
	require.NoError(t, err)
	assert.Empty(t, r.Name, "left to the pool")

	for name, tt := range map[string]struct {
		ann  map[string]string
		want string
	}{
		"no adapter":  {map[string]string{LoraBase: "hf://org/base"}, "annotation weightd.io/lora-adapter is missing"},
		"no base":     {map[string]string{LoraAdapter: "hf://org/a"}, "annotation weightd.io/lora-base is missing"},
		"name only":   {map[string]string{LoraName: "x"}, "annotation weightd.io/lora-base is missing"},
		"bad base":    {map[string]string{LoraBase: "nope", LoraAdapter: "hf://org/a"}, "annotation weightd.io/lora-base"},
		"bad adapter": {map[string]string{LoraBase: "hf://org/b", LoraAdapter: "hf://"}, "annotation weightd.io/lora-adapter"},
		"empty name":  {map[string]string{LoraBase: "hf://org/b", LoraAdapter: "hf://org/a", LoraName: " "}, "annotation weightd.io/lora-name"},
		"bad name":    {map[string]string{LoraBase: "hf://org/b", LoraAdapter: "hf://org/a", LoraName: "-x"}, "starting with a letter or digit"},
		"long name":   {map[string]string{LoraBase: "hf://org/b", LoraAdapter: "hf://org/a", LoraName: strings.Repeat("a", 65)}, "1 to 64"},
		"space name":  {map[string]string{LoraBase: "hf://org/b", LoraAdapter: "hf://org/a", LoraName: "a b"}, "annotation weightd.io/lora-name"},
		"slash name":  {map[string]string{LoraBase: "hf://org/b", LoraAdapter: "hf://org/a", LoraName: "org/a"}, "annotation weightd.io/lora-name"},
	} {
		_, ok, err := ParseAdapterRequest(tt.ann)
		assert.True(t, ok, name)
		if assert.Error(t, err, name) {
			assert.True(t, invalid(err), "%s: %v", name, err)
			assert.Contains(t, err.Error(), tt.want, name)
		}
	}
}

func FuzzParseWarmServer(f *testing.F) {
	f.Add("hf://org/base@main", "vllm", "8000", "4", "64")
	f.Add("oci://r.io/m:1", "sglang", " 1 ", "256", "")
	f.Add("", "tgi", "0x50", "-1", "99999999999999999999")
	f.Fuzz(func(t *testing.T, base, runtime, port, slots, rank string) {
		s, err := ParseWarmServer(map[string]string{WarmBase: base, WarmRuntime: runtime, WarmPort: port, WarmSlots: slots, WarmMaxRank: rank})
		if err != nil {
			if !invalid(err) {
				t.Fatalf("error %v wraps neither ref.ErrInvalid nor content.ErrInvalid", err)
			}
			return
		}
		if s.Port < 1 || s.Port > 65535 || s.Slots < 1 || s.Slots > MaxAdapterSlots || s.MaxRank < 1 || s.MaxRank > MaxLoraRank {
			t.Fatalf("out of bounds: %+v", s)
		}
		if s.Runtime != engine.VLLM && s.Runtime != engine.SGLang {
			t.Fatalf("runtime %q", s.Runtime)
		}
		if again, err := ref.Parse(s.Base.String()); err != nil || again.String() != s.Base.String() {
			t.Fatalf("base %q does not reparse: %v", s.Base, err)
		}
	})
}

func FuzzParseAdapterRequest(f *testing.F) {
	f.Add("hf://org/base@main", "hf://org/adapter", "my-adapter")
	f.Add("oci://r.io/m:1", "https://host/a.tar", "")
	f.Fuzz(func(t *testing.T, base, adapter, name string) {
		r, ok, err := ParseAdapterRequest(map[string]string{LoraBase: base, LoraAdapter: adapter, LoraName: name})
		if !ok {
			t.Fatal("a request with all three annotations asks for nothing")
		}
		if err != nil {
			if !invalid(err) {
				t.Fatalf("error %v wraps neither ref.ErrInvalid nor content.ErrInvalid", err)
			}
			return
		}
		if r.Name != "" && !engine.ValidAdapterName(r.Name) {
			t.Fatalf("name %q accepted", r.Name)
		}
		for _, parsed := range []ref.Ref{r.Base, r.Adapter} {
			if again, err := ref.Parse(parsed.String()); err != nil || again.String() != parsed.String() {
				t.Fatalf("reference %q does not reparse: %v", parsed, err)
			}
		}
	})
}
