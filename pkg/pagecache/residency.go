package pagecache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// lock locks f in memory if mlock is available. The first refusal of the
// kernel turns mlock off for good; files are then kept by re-warming.
// Called with t.mu held.
func (t *Tier) lock(f *file) {
	if !t.mlockOK || f.locked || f.mem == nil || t.lockedBytes()+f.size > t.lockCap {
		return
	}
	err := t.lockMem(f.mem)
	switch {
	case err == nil:
		f.locked = true
	case errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.EAGAIN):
		t.mlockOK = false
		t.opts.logger.Warn("mlock refused; keeping files in the page cache by re-warming them instead (CAP_IPC_LOCK or a RLIMIT_MEMLOCK as large as the budget allows locking)",
			"path", f.path, "bytes", f.size, "err", err)
	default:
		t.opts.logger.Warn("locking file in memory", "path", f.path, "err", err)
	}
}

// lockedBytes is the size of the locked files. Called with t.mu held.
func (t *Tier) lockedBytes() int64 {
	var n int64
	for _, f := range t.open {
		if f.locked {
			n += f.size
		}
	}
	return n
}

// cgroupMemoryMax is the memory.max of this process's cgroup (v2), 0 when
// there is none or it cannot be read.
func cgroupMemoryMax() int64 {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if dir, ok := strings.CutPrefix(strings.TrimSpace(line), "0::"); ok {
			v, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", filepath.Clean("/"+dir), "memory.max"))
			if err != nil {
				return 0
			}
			n, err := strconv.ParseInt(strings.TrimSpace(string(v)), 10, 64)
			if err != nil { // "max"
				return 0
			}
			return n
		}
	}
	return 0
}

// residency is how many bytes of f are in the page cache. Called with t.mu
// held.
func (t *Tier) residency(f *file) int64 {
	vec, err := t.mincore(f)
	if err != nil {
		return 0
	}
	return residentBytes(vec, f.size)
}

// residentBytes is how many bytes of a file of size bytes vec (from
// mincore) says are resident.
func residentBytes(vec []byte, size int64) int64 {
	var n int64
	for i, v := range vec {
		if v&1 != 0 {
			n += min(pageSize, size-int64(i)*pageSize)
		}
	}
	return n
}

// Resident returns how many bytes of the file at path are in the page cache
// (mincore over a read-only mapping of it), and its size.
func Resident(path string) (resident, size int64, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, 0, fmt.Errorf("opening %s: %w", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, 0, fmt.Errorf("checking %s: %w", path, err)
	}
	if st.Size() == 0 {
		return 0, 0, nil
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, 0, fmt.Errorf("mapping %s: %w", path, err)
	}
	defer func() { _ = unix.Munmap(mem) }() // a read-only mapping: nothing to lose
	vec := make([]byte, (st.Size()+pageSize-1)/pageSize)
	if err := mincore(mem, vec); err != nil {
		return 0, 0, fmt.Errorf("checking page cache residency of %s: %w", path, err)
	}
	return residentBytes(vec, st.Size()), st.Size(), nil
}

// mincore returns f's page residency vector. Called with t.mu held.
func (t *Tier) mincore(f *file) ([]byte, error) {
	if f.mem == nil {
		return nil, nil
	}
	vec := make([]byte, (int64(len(f.mem))+pageSize-1)/pageSize)
	if err := mincore(f.mem, vec); err != nil {
		t.opts.logger.Warn("checking page cache residency", "path", f.path, "err", err)
		return nil, err
	}
	return vec, nil
}

// warmAll reads in the pages of files that are not resident, at most
// WithWarmConcurrency files at once over the whole tier.
func (t *Tier) warmAll(ctx context.Context, files []*file) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, f := range files {
		select {
		case t.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		wg.Go(func() {
			defer func() { <-t.sem }()
			t.warm(ctx, f)
		})
	}
}

// warm reads in f's pages that are not resident: for each run of them,
// posix_fadvise WILLNEED a chunk ahead and sequential reads of warmChunk.
func (t *Tier) warm(ctx context.Context, f *file) {
	t.mu.Lock()
	if f.closed || f.locked {
		t.mu.Unlock()
		return
	}
	vec, err := t.mincore(f)
	t.mu.Unlock()
	if err != nil {
		return
	}
	bp := t.bufs.Get().(*[]byte)
	defer t.bufs.Put(bp)
	buf := *bp
	var read int64
	defer func() { t.m.rewarmed.Add(float64(read)) }()
	for _, r := range missing(vec, f.size) {
		for off := r.off; off < r.end; {
			n := min(int64(len(buf)), r.end-off)
			advise(f.f, off, min(2*int64(len(buf)), r.end-off))
			if t.limiter != nil {
				if err := t.limiter.WaitN(ctx, int(n)); err != nil {
					return
				}
			}
			got, err := f.f.ReadAt(buf[:n], off)
			read += int64(got)
			if err != nil {
				// io.EOF: truncated, os.ErrClosed: released; the next
				// check reports a changed file.
				if !errors.Is(err, io.EOF) && !errors.Is(err, os.ErrClosed) {
					t.opts.logger.Warn("reading file into the page cache", "path", f.path, "err", err)
				}
				return
			}
			if ctx.Err() != nil {
				return
			}
			off += n
		}
	}
}

// mincore is mincore(2), which golang.org/x/sys/unix does not wrap on Linux.
func mincore(mem, vec []byte) error {
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&mem[0])), uintptr(len(mem)), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// span is a byte range [off, end).
type span struct{ off, end int64 }

// missing returns the byte ranges of a file of size bytes whose pages vec
// (from mincore) says are not resident.
func missing(vec []byte, size int64) []span {
	var runs []span
	for i, v := range vec {
		if v&1 != 0 {
			continue
		}
		off := int64(i) * pageSize
		end := min(off+pageSize, size)
		if k := len(runs) - 1; k >= 0 && runs[k].end == off {
			runs[k].end = end
		} else {
			runs = append(runs, span{off, end})
		}
	}
	return runs
}

// advise tells the kernel that [off, off+n) of f is about to be read.
func advise(f *os.File, off, n int64) {
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) {
		_ = unix.Fadvise(int(fd), off, n, unix.FADV_WILLNEED) // advice: a failure only costs speed
	})
}
