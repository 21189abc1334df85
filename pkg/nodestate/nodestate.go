package nodestate

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Names on Node objects.
const (
	// LabelPrefix prefixes the label of each model or image the node holds
	// complete: LabelPrefix + Key(ref) = "ready".
	LabelPrefix = "models.weightd.io/"
	// LabelReady is the value of those labels.
	LabelReady = "ready"
	// SummaryAnnotation holds the JSON Summary.
	SummaryAnnotation = "weightd.io/cache"
	// MaxSummaryBytes bounds the summary annotation (the API server allows
	// 256 KiB for all of an object's annotations together).
	MaxSummaryBytes = 32 << 10
	// maxKeyName bounds the readable part of a key so that the whole key
	// fits a label name (63 bytes).
	maxKeyName = 40
)

// Key returns the stable short key of a canonical reference (ref.Ref's
// String): a readable part taken from the reference's last path element
// (lowercase letters, digits, '-', '.', '_'; at most 40 bytes), a '-', and
// the first 12 hex digits of the reference's sha256. The readable part helps
// people; the hash makes the key unique. It is a valid label name.
func Key(ref string) string {
	sum := sha256.Sum256([]byte(ref))
	h := hex.EncodeToString(sum[:6])
	name := readable(ref)
	if name == "" {
		return "m-" + h
	}
	return name + "-" + h
}

// readable is the last path element of ref, before any tag, revision,
// digest or query, lowercased and reduced to label characters.
func readable(ref string) string {
	s := ref
	if _, rest, ok := strings.Cut(s, "://"); ok {
		s = rest
	}
	s, _, _ = strings.Cut(s, "#")
	s, _, _ = strings.Cut(s, "?")
	s, _, _ = strings.Cut(s, "@")
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		s = s[i+1:]
	}
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		s = s[:i]
	}
	var b strings.Builder
	for _, c := range strings.ToLower(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '.', c == '_':
			b.WriteRune(c)
		default:
			b.WriteByte('-')
		}
		if b.Len() >= maxKeyName {
			break
		}
	}
	// A label name starts and ends with an alphanumeric character.
	return strings.Trim(b.String(), "-._")
}

// Label is the node label of ref: LabelPrefix + Key(ref).
func Label(ref string) string { return LabelPrefix + Key(ref) }

// State is where a model or image is on a node.
type State string

// States of an entry.
const (
	StateFetching State = "fetching"
	StateReady    State = "ready"
	StateFailed   State = "failed"
)

// Entry is one model or image in the summary.
type Entry struct {
	Key   string `json:"key"`
	Ref   string `json:"ref"` // canonical, query redacted
	State State  `json:"state"`
	// Bytes present of Total (Total is 0 until resolved).
	Bytes int64 `json:"bytes"`
	Total int64 `json:"total"`
	// Image is true for container images (imported into the runtime).
	Image bool `json:"image,omitempty"`
}

// Summary is the node's cache summary annotation.
type Summary struct {
	// V is the format version, 1.
	V       int     `json:"v"`
	Entries []Entry `json:"entries"`
	// Truncated counts entries left out to stay under MaxSummaryBytes.
	Truncated int `json:"truncated,omitempty"`
}

// Encode writes the summary as compact JSON of at most MaxSummaryBytes,
// dropping entries from the end (callers order them most important first:
// ready and in-flight before failed, recent before old) and counting them in
// Truncated.
func (s Summary) Encode() (string, error) {
	s.V = 1
	entries := s.Entries
	for n := len(entries); n >= 0; n-- {
		s.Entries = entries[:n]
		s.Truncated = len(entries) - n
		b, err := json.Marshal(s)
		if err != nil {
			return "", err
		}
		if len(b) <= MaxSummaryBytes {
			return string(b), nil
		}
		// Jump close to the size that fits rather than one at a time.
		if n > 1 {
			if fit := int(int64(n) * MaxSummaryBytes / int64(len(b))); fit < n-1 {
				n = fit + 1
			}
		}
	}
	return "", errors.New("summary: even an empty summary is too large")
}

// Decode parses a summary annotation. It is untrusted input for readers:
// oversized or malformed values are errors, unknown fields are ignored
// (newer agents may add some).
func Decode(s string) (Summary, error) {
	if len(s) > MaxSummaryBytes {
		return Summary{}, fmt.Errorf("summary annotation of %d bytes exceeds %d", len(s), MaxSummaryBytes)
	}
	var sum Summary
	if err := json.Unmarshal([]byte(s), &sum); err != nil {
		return Summary{}, fmt.Errorf("summary annotation: %w", err)
	}
	if sum.V != 1 {
		return Summary{}, fmt.Errorf("summary annotation: version %d, want 1", sum.V)
	}
	for i, e := range sum.Entries {
		if e.Bytes < 0 || e.Total < 0 || (e.Total > 0 && e.Bytes > e.Total) {
			return Summary{}, fmt.Errorf("summary annotation: entry %d: %d bytes of %d", i, e.Bytes, e.Total)
		}
	}
	return sum, nil
}

// Find returns the entry with key, if any.
func (s Summary) Find(key string) (Entry, bool) {
	i := slices.IndexFunc(s.Entries, func(e Entry) bool { return e.Key == key })
	if i < 0 {
		return Entry{}, false
	}
	return s.Entries[i], true
}
