//go:build linux && amd64

package loadtrace

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// The kernel wakes the reader once a wakeupFraction of the ring buffer is
// unread; below that the reader polls every pollEvery, so a record waits
// at most that long.
const (
	wakeupFraction = 8
	pollEvery      = 100 * time.Millisecond
)

// Layout of a ring buffer record (struct hdr, then for opens the path).
const (
	hdrSize  = 32
	pathSize = 512
)

// probe is the loaded and attached BPF program.
type probe struct {
	objs  loadtraceObjects
	links []link.Link
	rd    *ringbuf.Reader
	// wall - mono is the offset from bpf_ktime_get_ns to wall time.
	wall time.Time
	mono time.Duration
	// drops reads the kernel's drop counters, summed over CPUs.
	drops func() ([3]uint64, error)
}

// attach loads the program with the traced prefixes and attaches it.
func attach(cfg Config, prefixes []string) (*probe, error) {
	// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; a no-op after.
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("lifting the memlock limit: %w", err)
	}
	spec, err := loadLoadtrace()
	if err != nil {
		return nil, fmt.Errorf("loading the BPF object: %w", err)
	}
	spec.Maps["events"].MaxEntries = uint32(cfg.RingBytes)
	if err := spec.Variables["self_tgid"].Set(uint32(os.Getpid())); err != nil {
		return nil, fmt.Errorf("setting the agent's pid: %w", err)
	}
	if err := spec.Variables["wakeup_bytes"].Set(uint64(cfg.RingBytes / wakeupFraction)); err != nil {
		return nil, fmt.Errorf("setting the ring buffer's wakeup mark: %w", err)
	}
	p := &probe{}
	if err := spec.LoadAndAssign(&p.objs, nil); err != nil {
		return nil, fmt.Errorf("loading the BPF program: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			p.close()
		}
	}()
	for i, pre := range prefixes {
		var v loadtracePrefix
		v.Len = uint32(len(pre))
		for j := range len(pre) {
			v.S[j] = int8(pre[j])
		}
		if err := p.objs.Prefixes.Put(uint32(i), &v); err != nil {
			return nil, fmt.Errorf("setting traced directory %s: %w", pre, err)
		}
	}
	for _, a := range []struct {
		name string
		prog *ebpf.Program
	}{
		{"sys_enter", p.objs.SysEnter},
		{"sys_exit", p.objs.SysExit},
		{"sched_process_exit", p.objs.ProcessExit},
	} {
		l, err := link.AttachRawTracepoint(link.RawTracepointOptions{Name: a.name, Program: a.prog})
		if err != nil {
			return nil, fmt.Errorf("attaching to raw tracepoint %s: %w", a.name, err)
		}
		p.links = append(p.links, l)
	}
	if p.rd, err = ringbuf.NewReader(p.objs.Events); err != nil {
		return nil, fmt.Errorf("opening the ring buffer: %w", err)
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return nil, fmt.Errorf("reading the monotonic clock: %w", err)
	}
	p.wall, p.mono = time.Now(), time.Duration(ts.Nano())
	p.drops = p.readDrops
	ok = true
	return p, nil
}

func (p *probe) readDrops() ([3]uint64, error) {
	var out [3]uint64
	for i := range out {
		var per []uint64
		if err := p.objs.Drops.Lookup(uint32(i), &per); err != nil {
			return out, fmt.Errorf("reading drop counters: %w", err)
		}
		for _, n := range per {
			out[i] += n
		}
	}
	return out, nil
}

// read passes each record to handle until stop; a malformed record is
// skipped.
func (p *probe) read(handle func(event)) error {
	var rec ringbuf.Record
	p.rd.SetDeadline(time.Now().Add(pollEvery))
	for {
		if err := p.rd.ReadInto(&rec); err != nil {
			switch {
			case errors.Is(err, os.ErrDeadlineExceeded):
				p.rd.SetDeadline(time.Now().Add(pollEvery))
				continue
			case errors.Is(err, os.ErrClosed):
				return nil
			}
			return err
		}
		if ev, ok := p.decode(rec.RawSample); ok {
			handle(ev)
		}
	}
}

// decode parses a record: struct hdr {u64 ktime, cgroup; u32 pid, tgid;
// s32 fd; u32 kind}, then for an open the NUL-terminated path.
func (p *probe) decode(b []byte) (event, bool) {
	if len(b) < hdrSize {
		return event{}, false
	}
	le := binary.LittleEndian
	ev := event{
		time:   p.wall.Add(time.Duration(le.Uint64(b[0:])) - p.mono),
		cgroup: le.Uint64(b[8:]),
		tgid:   le.Uint32(b[20:]),
		fd:     int32(le.Uint32(b[24:])),
		kind:   le.Uint32(b[28:]),
	}
	if ev.kind == kindOpen {
		if len(b) < hdrSize+pathSize {
			return event{}, false
		}
		path := b[hdrSize : hdrSize+pathSize]
		n := 0
		for n < len(path) && path[n] != 0 {
			n++
		}
		ev.path = string(path[:n])
	}
	return ev, true
}

// stop makes read return.
func (p *probe) stop() { p.rd.Close() }

// close detaches and unloads the program.
func (p *probe) close() {
	if p.rd != nil {
		p.rd.Close()
	}
	for _, l := range p.links {
		l.Close()
	}
	p.objs.Close()
}
