// Package benchfig holds what the benches' JSON lines share about their
// figures.
package benchfig

import "math"

// Round is x to decimals places: a bench line keeps the digits a run can
// tell apart, not the float's noise.
func Round(x float64, decimals int) float64 {
	p := math.Pow10(decimals)
	return math.Round(x*p) / p
}
