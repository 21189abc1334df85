package csi

import (
	"testing"

	"github.com/weightd/weightd/pkg/prefetch"
)

// TestProgressMessage is what `kubectl describe pod` shows while a model
// volume waits for its fetch.
func TestProgressMessage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		st   prefetch.JobStatus
		want string
	}{
		{prefetch.JobStatus{State: prefetch.StateResolving}, "hf://o/m@main: resolving"},
		{prefetch.JobStatus{State: prefetch.StateFetching, BytesDone: 43 << 20, BytesTotal: 100 << 20, FilesDone: 1, FilesTotal: 3},
			"hf://o/m@main: fetching 43% of 100.0 MiB (1 of 3 files)"},
		{prefetch.JobStatus{State: prefetch.StateFetching, BytesDone: 50 << 20, BytesFromPeers: 30 << 20, BytesTotal: 100 << 20, FilesDone: 2, FilesTotal: 3},
			"hf://o/m@main: fetching 50% of 100.0 MiB, 60% from peers (2 of 3 files)"},
	} {
		if got := progress("hf://o/m@main", tc.st); got != tc.want {
			t.Errorf("progress(%+v) = %q, want %q", tc.st, got, tc.want)
		}
	}
}
