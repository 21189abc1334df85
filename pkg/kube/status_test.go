package kube

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/weightd/weightd/pkg/prefetch"
)

func TestPodStatus(t *testing.T) {
	t.Parallel()
	st := func(s prefetch.JobState, done, total int64) prefetch.JobStatus {
		return prefetch.JobStatus{Ref: "hf://org/m@main", State: s, BytesDone: done, BytesTotal: total}
	}
	failed := st(prefetch.StateFailed, 0, 0)
	failed.Error = "resolving: 404 " + strings.Repeat("é", 300)
	tests := []struct {
		name string
		jobs []prefetch.JobStatus
		want string
	}{
		{"none", nil, ""},
		{"queued", []prefetch.JobStatus{st(prefetch.StateQueued, 0, 0), st(prefetch.StateQueued, 0, 0)}, "queued"},
		{"resolving: size unknown", []prefetch.JobStatus{st(prefetch.StateResolving, 0, 0), st(prefetch.StateFetching, 5, 10)}, "fetching"},
		{"over all bytes", []prefetch.JobStatus{st(prefetch.StateReady, 40, 40), st(prefetch.StateFetching, 3, 60)}, "fetching 43%"},
		{"never 100 before ready", []prefetch.JobStatus{st(prefetch.StateImporting, 10, 10)}, "fetching 99%"},
		{"ready", []prefetch.JobStatus{st(prefetch.StateReady, 1, 1), st(prefetch.StateReady, 0, 0)}, "ready"},
		{"one failed", []prefetch.JobStatus{st(prefetch.StateReady, 1, 1), failed}, ""},
	}
	for _, tt := range tests {
		got := PodStatus(tt.jobs)
		if tt.name == "one failed" {
			assert.True(t, strings.HasPrefix(got, "failed: hf://org/m@main: resolving: 404 "), got)
			assert.LessOrEqual(t, len(got), MaxStatusLen)
			assert.True(t, strings.HasSuffix(got, "…"))
			assert.True(t, finalStatus(got))
			continue
		}
		assert.Equal(t, tt.want, got, tt.name)
	}
	assert.Equal(t, "fetching", statusKind("fetching 43%"))
	assert.Equal(t, "failed", statusKind("failed: x"))
	assert.False(t, finalStatus("fetching 99%"))
}

func TestMessages(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	jobs := []prefetch.JobStatus{
		{BytesTotal: 14_000_000_000, Finished: t0.Add(31 * time.Second)},
		{BytesTotal: 900_000_000, Finished: t0.Add(20 * time.Second)},
	}
	assert.Equal(t, "prefetched 14.9 GB in 31 s", prefetchedMessage(jobs, t0))
	assert.Equal(t, "prefetched 14.0 GB in 0.5 s", prefetchedMessage(jobs[:1], t0.Add(30500*time.Millisecond)))
	assert.Equal(t, "512 B", formatBytes(512))
	assert.Equal(t, "1.1 GB", formatBytes(1<<30))
	assert.Equal(t, "prefetching 1 reference: hf://a/b", prefetchingMessage([]string{"hf://a/b"}))
	assert.LessOrEqual(t, len(prefetchingMessage(make([]string, 1000))), MaxStatusLen)
}
