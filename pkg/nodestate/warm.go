package nodestate

import (
	"encoding/json"
	"fmt"
	"slices"
)

// What the agent publishes about the warm pool: on the Node, a label for each
// base model that a healthy warm server of the node keeps resident; on each
// warm server's pod, the adapters loaded in it, for routers with LoRA
// affinity.
//
//	node labels:
//	  warm.weightd.io/<key>: ready                  key = Key(base reference)
//	warm server pod annotations:
//	  weightd.io/loaded-adapters: ["a","b"]        EncodeAdapters
const (
	// WarmLabelPrefix prefixes the label of each warm base of the node:
	// WarmLabelPrefix + Key(ref) = LabelReady.
	WarmLabelPrefix = "warm.weightd.io/"
	// LoadedAdaptersAnnotation, on a warm server's pod, lists the names of
	// the adapters loaded in it (EncodeAdapters).
	LoadedAdaptersAnnotation = "weightd.io/loaded-adapters"
	// MaxAdaptersBytes bounds the loaded-adapters annotation.
	MaxAdaptersBytes = 16 << 10
)

// WarmLabel is the node label of a warm base (a canonical reference):
// WarmLabelPrefix + Key(ref).
func WarmLabel(ref string) string { return WarmLabelPrefix + Key(ref) }

// EncodeAdapters writes adapter names as the loaded-adapters annotation: a
// compact JSON array, sorted, without duplicates, of at most
// MaxAdaptersBytes (names at the end of the order are left out beyond it;
// a warm server's slots make that rare).
func EncodeAdapters(names []string) string {
	names = append([]string{}, slices.Compact(slices.Sorted(slices.Values(names)))...)
	for {
		b, _ := json.Marshal(names) // a list of strings always marshals
		if len(b) <= MaxAdaptersBytes {
			return string(b)
		}
		// Drop at least one, more when far over.
		cut := max(1, len(names)*(len(b)-MaxAdaptersBytes)/len(b))
		names = names[:len(names)-cut]
	}
}

// DecodeAdapters parses a loaded-adapters annotation. It is untrusted input
// for readers: oversized or malformed values are errors.
func DecodeAdapters(s string) ([]string, error) {
	if len(s) > MaxAdaptersBytes {
		return nil, fmt.Errorf("loaded-adapters annotation of %d bytes exceeds %d", len(s), MaxAdaptersBytes)
	}
	var names []string
	if err := json.Unmarshal([]byte(s), &names); err != nil {
		return nil, fmt.Errorf("loaded-adapters annotation: %w", err)
	}
	if names == nil {
		return nil, fmt.Errorf("loaded-adapters annotation: %q is not a list", s)
	}
	return names, nil
}
