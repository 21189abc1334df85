package policy

import (
	"strings"
	"testing"
	"time"

	"github.com/weightd/weightd/pkg/prefetch"
)

// FuzzWants: whatever a policy says, parsing it does not panic, every
// reference shown in the status is bounded and shows no query, and the
// entry built from it fits the schema's bounds.
func FuzzWants(f *testing.F) {
	for _, s := range []string{
		"hf://org/m@main", "oci://r/x:y", "https://h/m.json?sig=secret", "https://h/dir/?sig=secret",
		"nginx", "UPPER/Case", "", "?", "hf://" + strings.Repeat("a", 5000), "https://h/x?a b",
	} {
		f.Add(s, s)
	}
	f.Fuzz(func(t *testing.T, model, image string) {
		ws := Wants(Spec{Models: []string{model, model}, Images: []string{image}})
		if len(ws) > 3 || len(ws) == 0 {
			t.Fatalf("%d wants from 3 references", len(ws))
		}
		states := make([]RefState, 0, len(ws))
		for _, w := range ws {
			if len(w.Shown) > MaxRefLen {
				t.Fatalf("shown reference of %d bytes", len(w.Shown))
			}
			if _, q, ok := strings.Cut(w.Shown, "?"); ok && q != "REDACTED" && !strings.HasPrefix(q, "REDACTED") {
				t.Fatalf("shown reference %q keeps its query", w.Shown)
			}
			if (w.Err == nil) == (w.Ref == "") {
				t.Fatalf("want %+v: a reference or an error, not both", w)
			}
			st := RefState{Shown: w.Shown, State: prefetch.StateReady}
			if w.Err != nil {
				st = RefState{Shown: w.Shown, State: prefetch.StateFailed, Reason: w.Err.Error()}
			}
			states = append(states, st)
		}
		e := BuildEntry("n", 1, states, time.Now())
		for _, fl := range e.Failed {
			if len(fl.Reason) > MaxReasonLen {
				t.Fatalf("reason of %d bytes", len(fl.Reason))
			}
		}
		if len(e.Ready)+len(e.Fetching)+len(e.Failed) != len(ws) {
			t.Fatalf("entry %+v lost references", e)
		}
	})
}
