package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/prefetch"
)

// progress shows a job's progress to a person.
type progress interface {
	// update shows a new status of the job.
	update(st prefetch.JobStatus)
	// finish shows the final status, or that watching failed with err.
	finish(st prefetch.JobStatus, err error)
}

// newProgress returns a live progress bar (bytes, rate, ETA) when w is a
// terminal, and plain lines otherwise (logs of an init container, CI).
func newProgress(w io.Writer, ref string) progress {
	if isTerminal(w) {
		return &barProgress{w: w, ref: ref}
	}
	return &lineProgress{w: w, ref: ref, every: 2 * time.Second}
}

// isTerminal says whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// barProgress draws a progress bar once the job knows its size.
type barProgress struct {
	w   io.Writer
	ref string
	bar *progressbar.ProgressBar
}

func (p *barProgress) update(st prefetch.JobStatus) {
	if st.State != prefetch.StateFetching && !st.State.Finished() {
		return // the size is not known yet
	}
	if p.bar == nil {
		p.bar = progressbar.NewOptions64(max(st.BytesTotal, 1),
			progressbar.OptionSetWriter(p.w),
			progressbar.OptionShowBytes(true),
			progressbar.OptionShowTotalBytes(true),
			progressbar.OptionUseIECUnits(true),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionSetElapsedTime(true),
			progressbar.OptionSetWidth(30),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionSetTheme(progressbar.ThemeUnicode),
		)
	}
	p.bar.Describe(fmt.Sprintf("%s %d/%d files", modelName(st), st.FilesDone, st.FilesTotal))
	_ = p.bar.Set64(min(st.BytesDone, p.bar.GetMax64()))
}

func (p *barProgress) finish(st prefetch.JobStatus, err error) {
	p.update(st)
	if p.bar == nil {
		return
	}
	if err == nil && st.State == prefetch.StateReady {
		_ = p.bar.Finish()
	} else {
		_ = p.bar.Exit()
	}
	fmt.Fprintln(p.w)
}

// lineProgress writes a line per state change, and one every so often while
// the job fetches.
type lineProgress struct {
	w     io.Writer
	ref   string
	every time.Duration

	state prefetch.JobState
	last  time.Time // when the last line was written
	t0    time.Time // first fetching status: the start of the rate
	done0 int64
}

func (p *lineProgress) update(st prefetch.JobStatus) {
	now := time.Now()
	if st.State.Finished() {
		return // finish reports it
	}
	if st.State == prefetch.StateFetching && p.t0.IsZero() {
		p.t0, p.done0 = now, st.BytesDone
	}
	if st.State == p.state && now.Sub(p.last) < p.every {
		return
	}
	p.state, p.last = st.State, now
	if st.State != prefetch.StateFetching {
		fmt.Fprintf(p.w, "%s %s\n", st.State, p.ref)
		return
	}
	line := fmt.Sprintf("fetching %s: %s / %s (%.0f%%), %d/%d files", modelName(st),
		bytesize.IEC(st.BytesDone), bytesize.IEC(st.BytesTotal), percent(st.BytesDone, st.BytesTotal), st.FilesDone, st.FilesTotal)
	if el := now.Sub(p.t0); el > 0 && st.BytesDone > p.done0 {
		rate := float64(st.BytesDone-p.done0) / el.Seconds()
		eta := time.Duration(float64(st.BytesTotal-st.BytesDone) / rate * float64(time.Second))
		line += fmt.Sprintf(", %s/s, ETA %s", bytesize.IEC(int64(rate)), eta.Round(time.Second))
	}
	fmt.Fprintln(p.w, line)
}

func (p *lineProgress) finish(st prefetch.JobStatus, err error) {
	switch {
	case err != nil:
		fmt.Fprintf(p.w, "stopped watching %s: %v\n", p.ref, err)
	case st.State == prefetch.StateReady:
		el := st.Finished.Sub(st.Created)
		fmt.Fprintf(p.w, "ready %s: %s, %d files in %s (%s/s)\n", modelName(st),
			bytesize.IEC(st.BytesTotal), st.FilesTotal, el.Round(time.Millisecond), bytesize.IEC(int64(float64(st.BytesTotal)/max(el.Seconds(), 1e-3))))
	case st.State == prefetch.StateFailed:
		fmt.Fprintf(p.w, "failed %s: %s\n", p.ref, st.Error)
	}
}

// modelName is the job's model once resolved, else its reference.
func modelName(st prefetch.JobStatus) string {
	if st.Model == "" {
		return st.Ref
	}
	if st.Revision == "" {
		return st.Model
	}
	return st.Model + "@" + st.Revision
}

// drawBar is a text progress bar of width characters, "[####----]", for
// views that redraw whole screens (weightd status) rather than one bar.
func drawBar(done, total int64, width int) string {
	inner := max(width-2, 1)
	full := int(min(percent(done, total), 100) / 100 * float64(inner))
	return "[" + strings.Repeat("#", full) + strings.Repeat("-", inner-full) + "]"
}

func percent(done, total int64) float64 {
	if total <= 0 {
		return 100
	}
	return 100 * float64(done) / float64(total)
}
