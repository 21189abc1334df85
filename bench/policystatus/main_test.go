package main

import (
	"strings"
	"testing"
)

// TestStream feeds a watch stream in chunks of every size and checks the
// events, their bytes and the resourceVersions delivered.
func TestStream(t *testing.T) {
	lines := []string{
		`{"type":"ADDED","object":{"apiVersion":"weightd.io/v1alpha1","kind":"PrefetchPolicy","metadata":{"managedFields":[{"manager":"x"}],"name":"p","resourceVersion":"17"}}}`,
		`{"type":"BOOKMARK","object":{"kind":"PrefetchPolicy","metadata":{"resourceVersion":"18"}}}`,
		`{"type":"MODIFIED","object":{"metadata":{"name":"p","resourceVersion":"123456"},"status":{"nodes":[{"name":"a"}]}}}`,
	}
	text := strings.Join(lines, "\n") + "\n"
	for size := 1; size <= len(text); size++ {
		b := &bench{}
		b.on.Store(true)
		tp := &tap{b: b}
		s := &stream{t: tp, watch: true}
		for i := 0; i < len(text); i += size {
			s.feed([]byte(text[i:min(i+size, len(text))]))
		}
		s.flush()
		if got := b.events.Load(); got != 2 {
			t.Fatalf("chunks of %d: %d events, want 2", size, got)
		}
		if got, want := b.bytes.Load(), int64(len(lines[0])+len(lines[2])+2); got != want {
			t.Fatalf("chunks of %d: %d bytes, want %d", size, got, want)
		}
		var rvs []uint64
		for _, m := range tp.marks {
			rvs = append(rvs, m.rv)
		}
		if len(rvs) != 3 || rvs[0] != 17 || rvs[1] != 18 || rvs[2] != 123456 {
			t.Fatalf("chunks of %d: resourceVersions %v, want [17 18 123456]", size, rvs)
		}
		if _, ok := tp.reached(123456); !ok {
			t.Fatalf("chunks of %d: 123456 not reached", size)
		}
	}
}

// TestStreamList reads a list as one document: its first resourceVersion,
// no event.
func TestStreamList(t *testing.T) {
	b := &bench{}
	b.on.Store(true)
	tp := &tap{b: b}
	s := &stream{t: tp}
	s.feed([]byte(`{"apiVersion":"weightd.io/v1alpha1","items":[],"kind":"PrefetchPolicyList",`))
	s.feed([]byte(`"metadata":{"resourceVersion":"42"}}` + "\n"))
	s.flush()
	if b.events.Load() != 0 || len(tp.marks) != 1 || tp.marks[0].rv != 42 {
		t.Fatalf("events %d, marks %v", b.events.Load(), tp.marks)
	}
}
