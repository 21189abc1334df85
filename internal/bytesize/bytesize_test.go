package bytesize

import "testing"

func TestIEC(t *testing.T) {
	t.Parallel()
	for n, want := range map[int64]string{0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 24 << 20: "24.0 MiB", 1 << 30: "1.0 GiB", 3 << 40: "3.0 TiB", 1<<63 - 1: "8192.0 PiB"} {
		if got := IEC(n); got != want {
			t.Errorf("IEC(%d) = %q, want %q", n, got, want)
		}
	}
}
