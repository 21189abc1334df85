package fetch

import (
	"strings"
)

// Sanitize maps s to a valid model name segment or file name of at most max
// bytes: letters, digits, '.', '_' and '-', runs of anything else (and of
// '-') as one '-', starting with a letter or digit and ending with neither
// '.' nor '-'. An empty result becomes fallback.
func Sanitize(s string, max int, fallback string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_'
		switch {
		case ok:
			b.WriteByte(c)
		case b.Len() > 0 && !strings.HasSuffix(b.String(), "-"):
			b.WriteByte('-')
		}
	}
	out := strings.TrimLeft(b.String(), "._-")
	if len(out) > max {
		out = out[:max]
	}
	out = strings.TrimRight(out, ".-")
	if out == "" {
		return fallback
	}
	return out
}

// Truncate shortens s, which may come from the network, for an error message.
func Truncate(s string) string {
	if len(s) > 120 {
		return s[:120] + "…"
	}
	return s
}
