package fetch

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseContentRange(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in                 string
		first, last, total int64
		ok                 bool
	}{
		{"bytes 0-99/100", 0, 99, 100, true},
		{"bytes 5-5/*", 5, 5, -1, true},
		{"bytes 0-99/99", 0, 0, 0, false},
		{"bytes 9-1/100", 0, 0, 0, false},
		{"bytes -1-5/100", 0, 0, 0, false},
		{"bytes +1-5/100", 0, 0, 0, false},
		{"bytes 0-5", 0, 0, 0, false},
		{"bytes */100", 0, 0, 0, false},
		{"items 0-5/100", 0, 0, 0, false},
		{"bytes 0-99999999999999999999/100", 0, 0, 0, false},
		{"", 0, 0, 0, false},
	}
	for _, tt := range tests {
		first, last, total, err := ParseContentRange(tt.in)
		if !tt.ok {
			assert.Error(t, err, tt.in)
			continue
		}
		require.NoError(t, err, tt.in)
		assert.Equal(t, []int64{tt.first, tt.last, tt.total}, []int64{first, last, total}, tt.in)
	}
}
