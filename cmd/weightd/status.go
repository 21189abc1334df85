package main

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/weightd/weightd/internal/bytesize"
	"github.com/weightd/weightd/pkg/api"
	"github.com/weightd/weightd/pkg/cache"
	"github.com/weightd/weightd/pkg/prefetch"
)

// statusCmd shows the agent's state: cache, downloads, peers, the registry
// mirror, jobs, GPUs, warm servers and their adapters, recent model loads.
type statusCmd struct {
	API   string        `name:"api" help:"Agent API address." default:"${default_api}" env:"WEIGHTD_API"`
	JSON  bool          `name:"json" help:"Print the agent's status as JSON."`
	Watch time.Duration `name:"watch" help:"Show the status again every so often (such as 2s) until interrupted, redrawing the screen on a terminal; 0 shows it once." default:"0"`
}

// Limits of the status view.
const (
	statusWidth       = 100 // every line fits in this many columns
	statusFinishedMax = 5   // finished jobs shown, the most recent
	statusLoadsMax    = 10  // model loads shown, the most recent
)

func (c *statusCmd) Run(e *env) error {
	if c.Watch < 0 {
		return fmt.Errorf("--watch must not be negative, not %v", c.Watch)
	}
	client, err := api.NewClient(c.API)
	if err != nil {
		return err
	}
	tty := isTerminal(e.stdout)
	show := func() error {
		st, err := client.Status(e.ctx)
		if err != nil {
			return err
		}
		if c.JSON {
			return printJSON(e.stdout, st)
		}
		var buf bytes.Buffer
		if c.Watch > 0 {
			if tty {
				buf.WriteString("\x1b[H\x1b[2J") // home, clear the screen
			} else {
				buf.WriteString("\n")
			}
		}
		renderStatus(&buf, st, statusView{api: c.API, now: time.Now(), tty: tty})
		_, err = e.stdout.Write(buf.Bytes())
		return err
	}
	if err := show(); err != nil || c.Watch == 0 {
		return err
	}
	tick := time.NewTicker(c.Watch)
	defer tick.Stop()
	for {
		select {
		case <-e.ctx.Done():
			return nil
		case <-tick.C:
		}
		if err := show(); err != nil {
			if e.ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
}

// statusView is how the status is shown: from which API, at what time
// (relative times are counted from it), and whether on a terminal (bold
// headings; otherwise no escape sequence at all).
type statusView struct {
	api string
	now time.Time
	tty bool
}

// renderStatus writes st as sections of tables, each line at most
// statusWidth columns, every list in a stable order.
func renderStatus(w io.Writer, st api.Status, v statusView) {
	fmt.Fprintln(w, clip(fmt.Sprintf("weightd %s at %s", st.Version, v.api), statusWidth))
	u := st.Cache

	v.section(w, "CACHE", func(t *tabwriter.Writer) {
		used := fmt.Sprintf("%s in %d blobs", bytesize.IEC(u.Bytes), u.Blobs)
		budget := "no byte budget"
		if u.BudgetBytes > 0 {
			used += fmt.Sprintf(", %.0f%% of the budget", percent(u.Bytes, u.BudgetBytes))
			budget = bytesize.IEC(u.BudgetBytes)
		}
		row(t, "root", clip(u.Root, 86))
		row(t, "used", used)
		row(t, "budget", budget)
		diskFree := bytesize.IEC(u.DiskFree)
		if u.MinFree > 0 {
			diskFree += fmt.Sprintf(", keeps %s free", bytesize.IEC(u.MinFree))
		}
		row(t, "disk free", diskFree)
		row(t, "partial", fmt.Sprintf("%s in %d downloads", bytesize.IEC(u.PartialBytes), len(u.InFlight)))
	})

	flights := slices.Clone(u.InFlight)
	slices.SortFunc(flights, func(a, b cache.Flight) int { return cmp.Compare(a.Digest, b.Digest) })
	v.table(w, "DOWNLOADS", len(flights), []string{"BLOB", "PROGRESS", "BYTES", "WAITERS", "FOR"}, func(t *tabwriter.Writer) {
		for _, f := range flights {
			row(t, shortDigest(f.Digest.String()), progressCell(f.Done, f.Size, 20), doneOf(f.Done, f.Size),
				fmt.Sprint(f.Waiters), f.HeldFor.Round(time.Second).String())
		}
	})

	peers := slices.Clone(st.Peers)
	slices.SortFunc(peers, func(a, b api.Peer) int { return cmp.Compare(a.Name, b.Name) })
	v.table(w, "PEERS", len(peers), []string{"NAME", "CHUNK ADDRESS", "ZONE"}, func(t *tabwriter.Writer) {
		for _, p := range peers {
			row(t, clip(p.Name, 36), clip(p.ChunkAddr, 36), clip(cmp.Or(p.Zone, "-"), 20))
		}
	})

	if st.Mirror != nil {
		renderMirror(w, *st.Mirror, v)
	}

	jobs, hidden := shownJobs(st.Jobs)
	v.table(w, "JOBS", len(jobs), []string{"ID", "STATE", "MODEL", "PROGRESS", "BYTES"}, func(t *tabwriter.Writer) {
		for _, j := range jobs {
			row(t, clip(j.ID, 16), string(j.State), clip(modelName(j), 28), progressCell(j.BytesDone, j.BytesTotal, 12), doneOf(j.BytesDone, j.BytesTotal))
		}
	})
	for _, j := range jobs {
		if j.Error != "" {
			fmt.Fprintln(w, clip(fmt.Sprintf("  %s: %s", clip(j.ID, 16), oneLine(j.Error)), statusWidth))
		}
	}
	if hidden > 0 {
		fmt.Fprintf(w, "  (%d older finished jobs not shown; --json lists them)\n", hidden)
	}

	if len(st.Volumes) > 0 {
		volumePod := func(vol api.Volume) string {
			if vol.Pod == "" {
				return "pod " + vol.PodUID // the kubelet did not name it
			}
			return vol.Namespace + "/" + vol.Pod
		}
		vols := slices.Clone(st.Volumes)
		slices.SortFunc(vols, func(a, b api.Volume) int {
			return cmp.Or(cmp.Compare(volumePod(a), volumePod(b)), cmp.Compare(a.Name, b.Name))
		})
		v.table(w, "VOLUMES", len(vols), []string{"POD", "VOLUME", "MODEL", "SIZE", "BLOBS"}, func(t *tabwriter.Writer) {
			for _, vol := range vols {
				row(t, clip(volumePod(vol), 30), clip(vol.Name, 12), clip(vol.Ref, 28), bytesize.IEC(vol.Bytes), fmt.Sprint(vol.Blobs))
			}
		})
	}

	gpus := slices.Clone(st.GPUs)
	slices.SortFunc(gpus, func(a, b api.GPU) int { return cmp.Compare(a.Index, b.Index) })
	v.table(w, "GPUS", len(gpus), []string{"GPU", "NAME", "MEMORY", "USED", "WARM BASES"}, func(t *tabwriter.Writer) {
		for _, g := range gpus {
			used, total := int64(g.MemoryUsedBytes), int64(g.MemoryTotalBytes)
			bases := slices.Sorted(slices.Values(g.Bases))
			row(t, fmt.Sprint(g.Index), clip(g.Name, 24), progressCell(used, total, 10), doneOf(used, total), clip(cmp.Or(strings.Join(bases, ", "), "-"), 24))
		}
	})

	warm := slices.Clone(st.Warm)
	slices.SortFunc(warm, func(a, b api.WarmServer) int { return cmp.Compare(a.Pod, b.Pod) })
	v.table(w, "WARM SERVERS", len(warm), []string{"POD", "BASE", "RUNTIME", "HEALTH", "ADAPTERS"}, func(t *tabwriter.Writer) {
		for _, s := range warm {
			health := "healthy"
			if !s.Healthy {
				health = "unhealthy"
			}
			row(t, clip(s.Pod, 30), clip(s.Base, 28), clip(s.Runtime, 8), health, fmt.Sprintf("%d/%d", len(s.Adapters), s.Slots))
		}
	})
	for _, s := range warm {
		if s.Error != "" {
			fmt.Fprintln(w, clip(fmt.Sprintf("  %s: %s", clip(s.Pod, 30), oneLine(s.Error)), statusWidth))
		}
	}
	var adapters int
	for _, s := range warm {
		adapters += len(s.Adapters)
	}
	if adapters > 0 {
		v.table(w, "ADAPTERS", adapters, []string{"SERVER", "ADAPTER", "LAST USED", "IN USE", "PINNED"}, func(t *tabwriter.Writer) {
			for _, s := range warm {
				as := slices.Clone(s.Adapters)
				slices.SortFunc(as, func(a, b api.LoadedAdapter) int { return cmp.Compare(a.Name, b.Name) })
				for _, a := range as {
					pinned := "no"
					if a.Pinned {
						pinned = "yes"
					}
					row(t, clip(s.Pod, 30), clip(a.Name, 30), ago(v.now, a.LastUsed), fmt.Sprint(a.InUse), pinned)
				}
			}
		})
	}

	loads := slices.Clone(st.Loads)
	slices.SortStableFunc(loads, func(a, b api.ModelLoad) int {
		return cmp.Or(b.Started.Compare(a.Started), cmp.Compare(a.Pod, b.Pod), cmp.Compare(a.Model, b.Model))
	})
	if len(loads) > statusLoadsMax {
		loads = loads[:statusLoadsMax]
	}
	v.table(w, "MODEL LOADS", len(loads), []string{"STARTED", "POD", "MODEL", "SECONDS", "FILES"}, func(t *tabwriter.Writer) {
		for _, l := range loads {
			files := fmt.Sprint(l.Files)
			if l.Open > 0 {
				files += fmt.Sprintf(" (%d open)", l.Open)
			}
			row(t, ago(v.now, l.Started), clip(cmp.Or(l.Pod, "-"), 28), clip(l.Model, 30), fmt.Sprintf("%.1f", l.Seconds), files)
		}
	})
}

// renderMirror writes the registry mirror's section: where it listens, what
// it mirrors, and whether containerd reads its hosts.toml files, with
// what is wrong and the fix, wrapped, when it does not.
func renderMirror(w io.Writer, m api.MirrorStatus, v statusView) {
	v.section(w, "MIRROR", func(t *tabwriter.Writer) {
		row(t, "address", clip(m.Addr, 80))
		row(t, "registries", clip(cmp.Or(strings.Join(m.Registries, ", "), "-"), 80))
		if m.HostsDir == "" {
			row(t, "hosts dir", "- (no hosts.toml written)")
			return
		}
		row(t, "hosts dir", clip(m.HostsDir, 80))
		row(t, "containerd", cmp.Or(m.ConfigPathState, "not asked yet"))
		if m.ConfigPath != "" {
			row(t, "config_path", clip(m.ConfigPath, 80))
		}
		if m.ContainerdVersion != "" {
			row(t, "version", clip(m.ContainerdVersion, 80))
		}
	})
	for _, line := range wrapWords(oneLine(m.Problem), statusWidth-2) {
		fmt.Fprintln(w, "  "+line)
	}
}

// wrapWords cuts s into lines of at most width columns at spaces; a word
// longer than width is clipped.
func wrapWords(s string, width int) []string {
	var lines []string
	var line strings.Builder
	for _, word := range strings.Fields(s) {
		word = clip(word, width)
		n := utf8.RuneCountInString(line.String())
		if n > 0 && n+1+utf8.RuneCountInString(word) > width {
			lines = append(lines, line.String())
			line.Reset()
		}
		if line.Len() > 0 {
			line.WriteByte(' ')
		}
		line.WriteString(word)
	}
	if line.Len() > 0 {
		lines = append(lines, line.String())
	}
	return lines
}

// section writes a heading and the tab-separated rows fill writes.
func (v statusView) section(w io.Writer, title string, fill func(t *tabwriter.Writer)) {
	fmt.Fprintln(w)
	if v.tty {
		fmt.Fprintf(w, "\x1b[1m%s\x1b[0m\n", title)
	} else {
		fmt.Fprintln(w, title)
	}
	t := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fill(t)
	_ = t.Flush() // writes to a bytes.Buffer
}

// table writes a section with a header row, or "none" when it has no rows.
func (v statusView) table(w io.Writer, title string, rows int, head []string, fill func(t *tabwriter.Writer)) {
	v.section(w, title, func(t *tabwriter.Writer) {
		if rows == 0 {
			fmt.Fprintln(t, "  none")
			return
		}
		row(t, head...)
		fill(t)
	})
}

// row writes one indented, tab-separated row.
func row(t *tabwriter.Writer, cells ...string) {
	fmt.Fprintf(t, "  %s\n", strings.Join(cells, "\t"))
}

// shownJobs returns the jobs to show, oldest first: every unfinished one and
// the most recent finished ones; and how many finished ones it left out.
func shownJobs(all []prefetch.JobStatus) ([]prefetch.JobStatus, int) {
	jobs := slices.Clone(all)
	slices.SortFunc(jobs, func(a, b prefetch.JobStatus) int {
		return cmp.Or(a.Created.Compare(b.Created), cmp.Compare(a.ID, b.ID))
	})
	finished := 0
	for _, j := range jobs {
		if j.State.Finished() {
			finished++
		}
	}
	hidden := max(finished-statusFinishedMax, 0)
	out := jobs[:0]
	skip := hidden
	for _, j := range jobs {
		if j.State.Finished() && skip > 0 {
			skip--
			continue
		}
		out = append(out, j)
	}
	return out, hidden
}

// progressCell is a bar of width characters and the percentage done; "-"
// while the total is not known.
func progressCell(done, total int64, width int) string {
	if total <= 0 {
		return "-"
	}
	return fmt.Sprintf("%s %3.0f%%", drawBar(done, total, width), min(percent(done, total), 100))
}

// doneOf is "done / total" in bytes; "-" while the total is not known.
func doneOf(done, total int64) string {
	if total <= 0 {
		return "-"
	}
	return bytesize.IEC(done) + " / " + bytesize.IEC(total)
}

// shortDigest is "algorithm:" and the first 12 hex digits of a digest.
func shortDigest(d string) string {
	algo, hex, ok := strings.Cut(d, ":")
	if !ok || len(hex) <= 12 {
		return clip(d, 19)
	}
	return algo + ":" + hex[:12]
}

// clip shortens s to at most n columns (runes), ending it with "…" when it
// had to be cut.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}

// oneLine replaces the line breaks and tabs of s with spaces.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// ago is how long before now t was, in its largest unit: "12s ago".
func ago(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	switch {
	case d < time.Second:
		return "now"
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d/time.Minute))
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh ago", int(d/time.Hour))
	}
	return fmt.Sprintf("%dd ago", int(d/(24*time.Hour)))
}
