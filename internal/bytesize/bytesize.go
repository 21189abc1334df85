// Package bytesize formats byte counts for people, and parses the sizes
// people write in flags and configuration (Size): the CLI's tables and the
// CSI plugin's progress messages say sizes the same way.
package bytesize

import "fmt"

// IEC formats n bytes in the largest binary unit that keeps it readable:
// "512 B", "1.0 KiB", "14.2 GiB".
func IEC(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTP"[exp])
}
