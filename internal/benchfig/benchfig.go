// Package benchfig holds what the benches' JSON lines share about their
// figures.
package benchfig

import (
	"cmp"
	"math"
	"slices"
)

// Round is x to decimals places: a bench line keeps the digits a run can
// tell apart, not the float's noise.
func Round(x float64, decimals int) float64 {
	p := math.Pow10(decimals)
	return math.Round(x*p) / p
}

// Median is the middle of xs, the lower of the two middles for an even
// count (a figure some run reached, not an average of two), or the zero
// value for none. xs is left as it is.
func Median[T cmp.Ordered](xs []T) T {
	if len(xs) == 0 {
		var zero T
		return zero
	}
	s := slices.Sorted(slices.Values(xs))
	return s[(len(s)-1)/2]
}
