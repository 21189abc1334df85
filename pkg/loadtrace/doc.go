// Package loadtrace is weightd's eBPF model-load tracer: it watches the
// node's processes open, read and close files under the cache's model and
// blob directories, attributes them to pods through their cgroup ids, and
// reports per pod and model the model-load time (first open to last close)
// and the order in which the files were first read. The prefetcher fetches
// a model's first-read files first the next time (Tracer.Order).
//
// # What the kernel side sees
//
// One BPF object (bpf/loadtrace.bpf.c, compiled by bpf2go; the generated
// loadtrace_bpfel.go and .o are committed so that building needs no clang)
// attaches to raw tracepoints only, the kind that loads on locked-down
// kernels: raw_syscalls/sys_enter and sys_exit, and sched/sched_process_exit.
//
//   - a successful open(2), openat(2) or openat2(2) of an absolute path that
//     starts with one of the configured directories (at most 4, each under
//     255 bytes; the path compared and reported is the first 511 bytes of
//     the string the process passed). It is seen at the syscall's exit,
//     which finds the path's pointer in the saved registers and the string
//     resident (the kernel has just read it): a failed open costs no read
//     of its path, and nothing is kept between enter and exit. The open
//     adds (process, fd) to an LRU map of 65,536 tracked fds.
//     Relative paths (openat with a directory fd, or a working directory
//     inside the cache) are not seen: inference servers open weights by the
//     absolute paths their hub library builds.
//   - the first read(2), pread64(2), readv(2), preadv(2), preadv2(2) or mmap(2)
//     of a tracked fd: this is what orders the files.
//   - close(2) of a tracked fd, and the exit of a process that had tracked
//     fds (the kernel closes its fds without close(2)). close_range(2) and
//     dup2(2) over a tracked fd are not seen; such an fd ends when its process
//     exits or its number is opened again.
//
// Every other syscall costs a switch on its number (reads and closes one
// hash lookup). Events go to a ring buffer (1 MiB by default); when it is
// full the event is dropped, never waited for, and counted in a per-CPU
// array that weightd_loadtrace_dropped_events_total{reason} exports. The
// agent's own process is never traced (it reads blobs to serve peers): the
// kernel side compares host PIDs with os.Getpid(), which is the host PID
// only in the host's PID namespace, so in a pod the agent needs hostPID, or
// its own reads are traced as its pod's.
//
// # What userspace makes of it
//
// A path under a models directory,
// models--org--name/snapshots/<rev>/<file>, is model "org/name@rev" and
// file <file>; a blob opened directly, <blobs>/<hex>, is model and file
// "sha256:<hex>". Anything else under the prefixes (temporary snapshots,
// partial downloads) is ignored. The pod is the pod UID that
// podcgroup resolves from the cgroup id ("" for processes outside pods).
//
// A load of a model by a pod runs from the first open to the last close:
// when the pod's open count for the model returns to 0 and stays 0 for the
// quiet period, the load ends, its seconds go to weightd_model_load_seconds
// and, for a model, its first-read order replaces the one recorded for the
// model, persisted atomically in the state directory so that it survives
// restarts. Events lost to a full ring buffer make a load longer (a lost
// close) or its order shorter (a lost read); a load whose files stay open
// past MaxLoadAge is dropped without being measured.
//
// Loading needs CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN; root) and a
// kernel with BPF ring buffers (5.8 or later); no BTF, kprobes or tracefs.
// If the program cannot be loaded or attached (not privileged, an older or
// locked-down kernel, a non-Linux or non-amd64 build), Run logs once,
// sets weightd_loadtrace_available to 0 and returns nil: the agent works
// without it, and Order still serves the orders recorded before.
package loadtrace
