package benchfig

import (
	"testing"

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
