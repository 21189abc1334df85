package hubtest_test

import (
	"io"
	"testing"

	"github.com/weightd/weightd/internal/hubtest"
)

func BenchmarkGenerated(b *testing.B) {
	g := hubtest.Generated(1<<30, 1)
	buf := make([]byte, 1<<20)
	b.SetBytes(int64(len(buf)))
	off := int64(0)
	for b.Loop() {
		if _, err := g.ReadAt(buf, off); err != nil && err != io.EOF {
			b.Fatal(err)
		}
		off = (off + int64(len(buf)) + 3) % (1 << 30)
	}
}
