package bytesize

import (
	"strconv"
	"strings"
	"testing"
)

func TestParseSize(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in   string
		want Size
		err  string
	}{
		{"0", 0, ""},
		{"1048576", 1 << 20, ""},
		{"512MiB", 512 << 20, ""},
		{"1GiB", 1 << 30, ""},
		{"1 GiB", 1 << 30, ""},
		{"1gib", 1 << 30, ""},
		{"16M", 16 << 20, ""},
		{"2Gi", 2 << 30, ""},
		{"1GB", 1e9, ""},
		{"2.5GB", 2.5e9, ""},
		{"1.5KiB", 1536, ""},
		{"100kB", 100e3, ""},
		{"3TB", 3e12, ""},
		{"7B", 7, ""},
		{"", 0, "want a number"},
		{"GiB", 0, "want a number"},
		{"-1GiB", 0, "want a number"},
		{"1 parsec", 0, "want a number"},
		{"1.2.3MB", 0, "invalid syntax"},
		{"9223372036854775807", 1<<63 - 1, ""},
		{"9223372036854775808", 0, "out of range"},
		{"8388608TiB", 0, "too large"},
		{"9000000000000000000.5TB", 0, "too large"},
	}
	for _, tt := range tests {
		got, err := Parse(tt.in)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("Parse(%q) = %d, %v; want an error with %q", tt.in, got, err, tt.err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("Parse(%q) = %d, %v; want %d", tt.in, got, err, tt.want)
		}
	}
}

// FuzzParseSize checks that Parse never panics nor returns a negative
// size, and that a plain integer is read exactly.
func FuzzParseSize(f *testing.F) {
	for _, s := range []string{"1GiB", "512MiB", "2.5GB", "0", "1e9", "9223372036854775807", ".", "1..2k"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := Parse(s)
		if err != nil {
			return
		}
		if n < 0 {
			t.Fatalf("Parse(%q) = %d: negative", s, n)
		}
		if i, err := strconv.ParseInt(s, 10, 64); err == nil && int64(n) != i {
			t.Fatalf("Parse(%q) = %d, want %d", s, n, i)
		}
	})
}

// kong decodes a map flag's values from YAML as JSON: sizes with units and
// plain numbers alike.
func TestSizeUnmarshalJSON(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]Size{`"500MiB"`: 500 << 20, `1048576`: 1 << 20, `"2.5GB"`: 2_500_000_000, `0`: 0} {
		var got Size
		if err := got.UnmarshalJSON([]byte(in)); err != nil || got != want {
			t.Errorf("%s: %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{`"fast"`, `-1`, `true`, `{}`, ``} {
		var got Size
		if err := got.UnmarshalJSON([]byte(in)); err == nil {
			t.Errorf("%s: %d, want an error", in, got)
		}
	}
}
