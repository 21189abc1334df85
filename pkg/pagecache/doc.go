// Package pagecache is weightd's DRAM tier: it keeps the files of pinned base
// models in the page cache within a memory budget, so that a warm inference
// server that crashes reloads its weights at memory speed, not disk speed.
//
// Owners (a warm server, say) Keep lists of files or directories. Symlinks
// are followed (a model in the cache is a directory of links into blobs/)
// and a file is known by its device and inode, so a blob kept by two owners
// counts once. Files are admitted in a fixed order: owners in the order of
// their first Keep, then each owner's files in the order given (a
// directory's files in lexical order). Each file that fits in what is left of
// the budget is kept; one that does not is left out and reported with
// ErrOverBudget (by Keep, Check and Status), and a later, smaller file may
// still fit. Releasing an owner frees its share and admits what now fits.
//
// A kept file is mapped read-only, read in (posix_fadvise WILLNEED and a
// sequential read-through of the pages that are not resident, bounded in
// concurrency and optionally in rate, so that it never starves the node) and
// locked with mlock where the kernel allows it (CAP_IPC_LOCK, or a
// RLIMIT_MEMLOCK as large as the budget). Where the kernel refuses, the tier
// logs it once and keeps files by re-warming instead: Run checks residency
// with mincore periodically and reads back what the kernel dropped. The tier
// never touches its mappings' memory, so a file truncated under it cannot
// fault the process; a file that disappears, is replaced or changes size is
// dropped and reported (ErrChanged, or the error of stat) until it is kept
// again.
//
// The page cache is charged to the memory cgroup of the process that reads
// it in: the agent's memory limit must leave room for the budget. Locked
// pages cannot be reclaimed, so the tier locks at most half of its cgroup's
// memory.max (files beyond it are kept by re-warming) and warns when the
// budget is larger than that.
package pagecache
