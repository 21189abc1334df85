package benchfig

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestRound(t *testing.T) {
	t.Parallel()
	assert.Equal(t, 1.153, Round(1.15349, 3))
	assert.Equal(t, 1.154, Round(1.1535, 3))
	assert.Equal(t, 0.6214, Round(0.62136, 4))
	assert.Equal(t, -2.5, Round(-2.49999, 3))
	assert.Equal(t, 3.0, Round(3, 3))
}

func TestMedian(t *testing.T) {
	t.Parallel()
	xs := []float64{3, 1, 2}
	assert.Equal(t, 2.0, Median(xs))
	assert.Equal(t, []float64{3, 1, 2}, xs, "left as it was")
	assert.Equal(t, 2.0, Median([]float64{4, 1, 2, 3}), "the lower middle")
	assert.Equal(t, time.Second, Median([]time.Duration{time.Second}))
	assert.Zero(t, Median[float64](nil))
}
