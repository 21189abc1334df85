package byterange

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	t.Parallel()
	tests := []struct {
		h          string
		size       int64
		start, end int64
		err        error
	}{
		{"bytes=10-99", 300, 10, 100, nil},
		{"bytes=290-", 300, 290, 300, nil},
		{"bytes=290-1000", 300, 290, 300, nil},
		{"bytes=-5", 300, 295, 300, nil},
		{"bytes=-500", 300, 0, 300, nil},
		{"bytes= 7-7", 300, 7, 8, nil},
		{"bytes=300-", 300, 0, 0, ErrUnsatisfiable},
		{"bytes=9-1", 300, 0, 0, ErrUnsatisfiable},
		{"bytes=-0", 300, 0, 0, ErrUnsatisfiable},
		{"bytes=-5", 0, 0, 0, ErrUnsatisfiable},
		{"bytes=+5-", 300, 0, 0, ErrUnsatisfiable},
		{"bytes=-+5", 300, 0, 0, ErrUnsatisfiable},
		{"bytes=5", 300, 0, 0, ErrUnsatisfiable},
		{"bytes=0-99999999999999999999", 300, 0, 0, ErrUnsatisfiable},
		{"bytes=0-1,5-6", 300, 0, 0, ErrUnsupported},
		{"items=0-1", 300, 0, 0, ErrUnsupported},
		{"", 300, 0, 0, ErrUnsupported},
	}
	for _, tt := range tests {
		start, end, err := Parse(tt.h, tt.size)
		if tt.err != nil {
			assert.ErrorIs(t, err, tt.err, "%q of %d bytes", tt.h, tt.size)
			continue
		}
		require.NoError(t, err, "%q of %d bytes", tt.h, tt.size)
		assert.Equal(t, []int64{tt.start, tt.end}, []int64{start, end}, "%q of %d bytes", tt.h, tt.size)
	}
}

// A client's Range header is untrusted: whatever it says, a range that
// parses lies inside the resource and is not empty.
func FuzzParse(f *testing.F) {
	for _, h := range []string{"bytes=0-0", "bytes=5-", "bytes=-5", "bytes=1-2,3-4", "bytes=9223372036854775807-"} {
		f.Add(h, int64(100))
	}
	f.Fuzz(func(t *testing.T, h string, size int64) {
		start, end, err := Parse(h, size)
		if err != nil {
			if err != ErrUnsupported && err != ErrUnsatisfiable {
				t.Fatalf("Parse(%q, %d): unexpected error %v", h, size, err)
			}
			return
		}
		if start < 0 || start >= end || end > size {
			t.Fatalf("Parse(%q, %d) = [%d, %d): outside the resource or empty", h, size, start, end)
		}
	})
}
