package kube

import (
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/weightd/weightd/pkg/prefetch"
)

// MaxStatusLen bounds the value of the pod status annotation
// (podrequest.Status) and of Event messages, in bytes.
const MaxStatusLen = 256

// Values of the pod status annotation; a failure is "failed: <ref>: <reason>"
// and progress "fetching 43%" (or "fetching" while some reference is not yet
// resolved, its size unknown).
const (
	StatusQueued   = "queued"
	StatusFetching = "fetching"
	StatusReady    = "ready"
	StatusFailed   = "failed"
)

// PodStatus is the status annotation of a pod whose references are fetched
// by jobs: "failed: <ref>: <reason>" as soon as one job failed (the pod cannot
// have everything it asked for), "ready" when every job is ready, "queued"
// while none has started, else "fetching N%" over the bytes of all of them
// (at most 99% until all are ready). It is at most MaxStatusLen bytes; ""
// when there are no jobs.
func PodStatus(jobs []prefetch.JobStatus) string {
	if len(jobs) == 0 {
		return ""
	}
	ready, queued, known := 0, 0, true
	var done, total int64
	for _, j := range jobs {
		switch j.State {
		case prefetch.StateFailed:
			return bound(StatusFailed + ": " + j.Ref + ": " + j.Error)
		case prefetch.StateReady:
			ready++
		case prefetch.StateQueued:
			queued++
			known = false
		case prefetch.StateResolving:
			known = false
		}
		done += j.BytesDone
		total += j.BytesTotal
	}
	switch {
	case ready == len(jobs):
		return StatusReady
	case queued == len(jobs):
		return StatusQueued
	case !known || total <= 0:
		return StatusFetching
	}
	pct := min(done*100/total, 99)
	return fmt.Sprintf("%s %d%%", StatusFetching, pct)
}

// statusKind is the state word of a status value: queued, fetching, ready,
// failed (or what another writer put there).
func statusKind(s string) string {
	if i := strings.IndexAny(s, " :"); i >= 0 {
		return s[:i]
	}
	return s
}

// finalStatus reports whether a status value is one a pod keeps: ready or
// failed.
func finalStatus(s string) bool {
	k := statusKind(s)
	return k == StatusReady || k == StatusFailed
}

// bound cuts s to at most MaxStatusLen bytes, on a rune boundary, marking the
// cut with an ellipsis.
func bound(s string) string { return boundTo(s, MaxStatusLen) }

// boundTo cuts s to at most n bytes, on a rune boundary, marking the cut
// with an ellipsis.
func boundTo(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const ellipsis = "…"
	cut := n - len(ellipsis)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + ellipsis
}

// Event reasons on pods.
const (
	ReasonInvalidAnnotation = "InvalidAnnotation"
	ReasonPrefetching       = "Prefetching"
	ReasonPrefetched        = "Prefetched"
	ReasonPrefetchFailed    = "PrefetchFailed"
)

// prefetchingMessage is the message of the Prefetching event.
func prefetchingMessage(refs []string) string {
	noun := "references"
	if len(refs) == 1 {
		noun = "reference"
	}
	return bound(fmt.Sprintf("prefetching %d %s: %s", len(refs), noun, strings.Join(refs, ", ")))
}

// prefetchedMessage is the message of the Prefetched event: the bytes of all
// the pod's references and the time from intake to the last one ready (a
// fraction of a second when they were in the cache already). Where the bytes
// came from (peers or origin, or the cache) is not said: the swarm counts it
// per node, not per job.
func prefetchedMessage(jobs []prefetch.JobStatus, since time.Time) string {
	var total int64
	for _, j := range jobs {
		total += j.BytesTotal
	}
	return fmt.Sprintf("prefetched %s in %s", formatBytes(total), formatSeconds(readySeconds(jobs, since)))
}

// readySeconds is the time from a pod's intake (since) to the last of its
// jobs finished ready: 0 when they were ready before. The Prefetched event
// and weightd_pod_prefetch_ready_seconds both report it.
func readySeconds(jobs []prefetch.JobStatus, since time.Time) time.Duration {
	var last time.Time
	for _, j := range jobs {
		if j.Finished.After(last) {
			last = j.Finished
		}
	}
	return max(last.Sub(since), 0)
}

// formatBytes writes n in decimal units: 14.9 GB, 512 MB, 0 B.
func formatBytes(n int64) string {
	const unit = 1000
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	v, i := float64(n), -1
	for v >= unit && i < 4 {
		v /= unit
		i++
	}
	return fmt.Sprintf("%.1f %cB", v, "kMGTP"[i])
}

// formatSeconds writes d as seconds: 0.4 s, 31 s.
func formatSeconds(d time.Duration) string {
	if s := d.Seconds(); s < 10 {
		return fmt.Sprintf("%.1f s", s)
	}
	return fmt.Sprintf("%.0f s", d.Seconds())
}
