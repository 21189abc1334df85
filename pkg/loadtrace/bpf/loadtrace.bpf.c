// SPDX-License-Identifier: GPL-2.0
// Model-load tracer: raw_syscalls sys_enter/sys_exit and sched_process_exit.
// See doc.go for what it reports and what it misses.
#include <linux/bpf.h>
#include <asm/ptrace.h>
#include <bpf/bpf_helpers.h>

#define PATH_LEN 512
#define PREFIX_LEN 256
#define MAX_PREFIXES 4

#define SYS_READ 0
#define SYS_OPEN 2
#define SYS_CLOSE 3
#define SYS_MMAP 9
#define SYS_PREAD64 17
#define SYS_READV 19
#define SYS_PREADV 295
#define SYS_PREADV2 327
#define SYS_OPENAT 257
#define SYS_OPENAT2 437

enum kind { KIND_OPEN = 1, KIND_READ = 2, KIND_CLOSE = 3, KIND_EXIT = 4 };
enum drop { DROP_RINGBUF = 0, DROP_FDS = 1, DROP_PATH = 2, DROP_MAX = 3 };

// self_tgid is the agent's own process, never traced (it reads blobs to
// serve peers); set at load.
volatile const __u32 self_tgid = 0;

// wakeup_bytes: unread bytes in the ring buffer that wake the reader; set
// at load.
volatile const __u64 wakeup_bytes = 0;

struct prefix {
	__u32 len;
	char s[PREFIX_LEN];
};

struct hdr {
	__u64 ktime;
	__u64 cgroup;
	__u32 pid;
	__u32 tgid;
	__s32 fd;
	__u32 kind;
};

struct open_event {
	struct hdr h;
	char path[PATH_LEN];
};

struct fdkey {
	__u32 tgid;
	__s32 fd;
};

struct path {
	char s[PATH_LEN];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_PREFIXES);
	__type(key, __u32);
	__type(value, struct prefix);
} prefixes SEC(".maps");

// tracked: open fds of traced files; the value says whether it was read.
// LRU: the fds of processes that exited without their exit being seen age out.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct fdkey);
	__type(value, __u8);
} tracked SEC(".maps");

// procs: processes with traced files opened, so that their exit is reported.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
} procs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DROP_MAX);
	__type(key, __u32);
	__type(value, __u64);
} drops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct path);
} scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} events SEC(".maps");

static __always_inline void count_drop(__u32 why)
{
	__u64 *n = bpf_map_lookup_elem(&drops, &why);
	if (n)
		(*n)++;
}

static __always_inline void fill(struct hdr *h, __u64 id, __s32 fd, __u32 kind)
{
	h->ktime = bpf_ktime_get_ns();
	h->cgroup = bpf_get_current_cgroup_id();
	h->pid = (__u32)id;
	h->tgid = id >> 32;
	h->fd = fd;
	h->kind = kind;
}

// submit commits a record and wakes the reader only once wakeup_bytes have
// built up: a wakeup per record costs the traced process an interrupt and
// the reader a context switch for each file opened. The reader also polls.
static __always_inline void submit(void *rec)
{
	__u64 avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	bpf_ringbuf_submit(rec, avail >= wakeup_bytes ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

static __always_inline void emit(__u64 id, __s32 fd, __u32 kind)
{
	struct hdr *h = bpf_ringbuf_reserve(&events, sizeof(*h), 0);
	if (!h) {
		count_drop(DROP_RINGBUF);
		return;
	}
	fill(h, id, fd, kind);
	submit(h);
}

// matches says whether path starts with one of the configured prefixes.
static __always_inline int matches(const char *path)
{
	for (__u32 i = 0; i < MAX_PREFIXES; i++) {
		__u32 k = i;
		struct prefix *p = bpf_map_lookup_elem(&prefixes, &k);
		if (!p || p->len == 0 || p->len > PREFIX_LEN)
			continue;
		int ok = 1;
		for (__u32 j = 0; j < PREFIX_LEN; j++) {
			if (j >= p->len)
				break;
			if (path[j] != p->s[j]) {
				ok = 0;
				break;
			}
		}
		if (ok)
			return 1;
	}
	return 0;
}

static __always_inline int on_read(__u64 id, __s32 fd)
{
	struct fdkey k = {.tgid = id >> 32, .fd = fd};
	__u8 *read = bpf_map_lookup_elem(&tracked, &k);
	if (!read || *read)
		return 0;
	*read = 1;
	emit(id, fd, KIND_READ);
	return 0;
}

static __always_inline int on_close(__u64 id, __s32 fd)
{
	struct fdkey k = {.tgid = id >> 32, .fd = fd};
	if (bpf_map_delete_elem(&tracked, &k))
		return 0;
	emit(id, fd, KIND_CLOSE);
	return 0;
}

SEC("raw_tracepoint/sys_enter")
int sys_enter(struct bpf_raw_tracepoint_args *ctx)
{
	long nr = (long)ctx->args[1];
	struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
	unsigned long a = 0;

	switch (nr) {
	case SYS_READ:
	case SYS_PREAD64:
	case SYS_READV:
	case SYS_PREADV:
	case SYS_PREADV2:
		bpf_probe_read_kernel(&a, sizeof(a), &regs->rdi);
		return on_read(bpf_get_current_pid_tgid(), (__s32)a);
	case SYS_MMAP:
		bpf_probe_read_kernel(&a, sizeof(a), &regs->r8);
		return on_read(bpf_get_current_pid_tgid(), (__s32)a);
	case SYS_CLOSE:
		bpf_probe_read_kernel(&a, sizeof(a), &regs->rdi);
		return on_close(bpf_get_current_pid_tgid(), (__s32)a);
	}
	return 0;
}

// sys_exit sees a successful open with its path: the syscall's arguments
// are still in the saved registers, and the kernel has just read the
// string, so it is resident. Only an open that succeeds costs a read of its
// path, and nothing is kept from enter to exit.
SEC("raw_tracepoint/sys_exit")
int sys_exit(struct bpf_raw_tracepoint_args *ctx)
{
	struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
	long ret = (long)ctx->args[1];
	unsigned long nr = 0, upath = 0;
	__u32 zero = 0;

	bpf_probe_read_kernel(&nr, sizeof(nr), &regs->orig_rax);
	if (ret < 0 || (nr != SYS_OPENAT && nr != SYS_OPENAT2 && nr != SYS_OPEN))
		return 0;
	__u64 id = bpf_get_current_pid_tgid();
	if ((id >> 32) == self_tgid)
		return 0;
	bpf_probe_read_kernel(&upath, sizeof(upath), nr == SYS_OPEN ? &regs->rdi : &regs->rsi);
	struct path *p = bpf_map_lookup_elem(&scratch, &zero);
	if (!p)
		return 0;
	long n = bpf_probe_read_user_str(p->s, PATH_LEN, (const char *)upath);
	if (n < 0) {
		count_drop(DROP_PATH);
		return 0;
	}
	if (n <= 1 || p->s[0] != '/' || !matches(p->s))
		return 0;
	struct open_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		count_drop(DROP_RINGBUF);
		return 0;
	}
	struct fdkey k = {.tgid = id >> 32, .fd = (__s32)ret};
	__u8 unread = 0, one = 1;
	if (bpf_map_update_elem(&tracked, &k, &unread, BPF_ANY)) {
		count_drop(DROP_FDS);
		bpf_ringbuf_discard(e, BPF_RB_NO_WAKEUP);
		return 0;
	}
	if (!bpf_map_lookup_elem(&procs, &k.tgid))
		bpf_map_update_elem(&procs, &k.tgid, &one, BPF_ANY);
	fill(&e->h, id, (__s32)ret, KIND_OPEN);
	bpf_probe_read_kernel_str(e->path, PATH_LEN, p->s);
	submit(e);
	return 0;
}

// sched_process_exit: a process with traced files exits; the kernel closes
// its fds without close(2), so userspace ends its files here.
SEC("raw_tracepoint/sched_process_exit")
int process_exit(struct bpf_raw_tracepoint_args *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32;
	if ((__u32)id != tgid)
		return 0;
	if (bpf_map_delete_elem(&procs, &tgid))
		return 0;
	emit(id, -1, KIND_EXIT);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
