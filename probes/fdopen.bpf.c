/* fdopen.bpf.c: which path each file descriptor of a traced process refers to.
 * openat/openat2/open are remembered at entry (the user pointer to the name) and
 * emitted at exit with the new fd, so fileio events can be resolved to paths.  close and
 * dup2/dup3 onto a number are emitted too (no path; a dup with the number it copies): what
 * the number refers to after a close is not an open's, so user space asks /proc instead of
 * naming a closed file, and after a dup it is what the copied number was. */

#include "kvtrace.h"

#define KV_PATH_MAX 256

struct kv_open_start {
    u64 ts;
    u64 filename;   /* user pointer */
    s32 dfd;
    u32 flags;
};

struct kv_fdopen_event {
    struct kv_hdr h;
    u64 ts_enter;
    s32 fd;         /* result: fd, or -errno */
    s32 dfd;
    u32 flags;
    u32 op;         /* KV_FD_* */
    char path[KV_PATH_MAX];
};

#define KV_FD_OPEN  0
#define KV_FD_CLOSE 1
#define KV_FD_DUP   2   /* dup2/dup3 onto fd */

BPF_TABLE("lru_hash", u32, struct kv_open_start, open_start, 16384);

static __always_inline int kv_open_enter(s64 dfd, const char *filename, u64 flags)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!kv_is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct kv_open_start s = {};
    s.ts = bpf_ktime_get_ns();
    s.filename = (u64)filename;
    s.dfd = (s32)dfd;
    s.flags = (u32)flags;
    open_start.update(&tid, &s);
    return 0;
}

static __always_inline int kv_open_exit(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct kv_open_start *s = open_start.lookup(&tid);
    if (!s)
        return 0;
    struct kv_open_start st = *s;
    open_start.delete(&tid);
#ifdef KV_FD_SKIP
    kv_fd_forget(id >> 32, ret);   /* a file on a number once skipped as not a file */
#endif
    struct kv_fdopen_event *e = events.ringbuf_reserve(sizeof(struct kv_fdopen_event));
    if (!e) {
        kv_count_lost(KV_KIND_FDOPEN);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_FDOPEN, sizeof(*e), id >> 32, tid);
    e->ts_enter = st.ts;
    e->fd = (s32)ret;
    e->dfd = st.dfd;
    e->flags = st.flags;
    e->op = KV_FD_OPEN;
    bpf_probe_read_user_str(e->path, sizeof(e->path), (const void *)st.filename);
    kv_submit(e, sizeof(*e));
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)  { return kv_open_enter(args->dfd, args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_exit_openat)   { return kv_open_exit(args->ret); }
#ifdef KV_HAVE_OPENAT2
TRACEPOINT_PROBE(syscalls, sys_enter_openat2) { return kv_open_enter(args->dfd, args->filename, 0); }
TRACEPOINT_PROBE(syscalls, sys_exit_openat2)  { return kv_open_exit(args->ret); }
#endif
#ifdef KV_HAVE_OPEN
TRACEPOINT_PROBE(syscalls, sys_enter_open)    { return kv_open_enter(-100, args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_exit_open)     { return kv_open_exit(args->ret); }
#endif

/* The number no longer refers to what was opened on it (emitted at entry: a failed close or
 * dup leaves the number as it was, which /proc then says). */
static __always_inline int kv_fd_gone(s64 fd, u32 op, s64 oldfd)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!kv_is_target(id >> 32) || fd < 0)
        return 0;
#ifdef KV_FD_SKIP
    kv_fd_forget(id >> 32, fd);
#endif
    struct kv_fdopen_event *e = events.ringbuf_reserve(sizeof(struct kv_fdopen_event));
    if (!e) {
        kv_count_lost(KV_KIND_FDOPEN);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_FDOPEN, sizeof(*e), id >> 32, (u32)id);
    e->ts_enter = e->h.ts;
    e->fd = (s32)fd;
    e->dfd = (s32)oldfd;   /* dup: the number duplicated from */
    e->flags = 0;
    e->op = op;
    e->path[0] = 0;
    kv_submit(e, sizeof(*e));
    return 0;
}

#ifdef KV_HAVE_FD_GONE
TRACEPOINT_PROBE(syscalls, sys_enter_close)   { return kv_fd_gone(args->fd, KV_FD_CLOSE, -1); }
TRACEPOINT_PROBE(syscalls, sys_enter_dup2)    { return kv_fd_gone(args->newfd, KV_FD_DUP, args->oldfd); }
TRACEPOINT_PROBE(syscalls, sys_enter_dup3)    { return kv_fd_gone(args->newfd, KV_FD_DUP, args->oldfd); }
#endif

#ifdef KV_FD_SKIP
/* Numbers born as sockets, eventfds, timerfds, signalfds, epoll instances, pipes or socket
 * pairs: skipped from their first read or write.  Without this the kernel learns what a number
 * is only once user space has seen a row of it and asked /proc, at the next flush
 * (kvtrace/capture/fdskip.py), and an HTTP connection that serves one request is closed by then:
 * all its writes traced.  Numbers open before the attach are put in by user space as it starts;
 * a number from anything else (dup, fcntl, a descriptor passed over a socket) is still learnt
 * from its rows.  Any close, dup onto, or open returning the number takes it out. */
static __always_inline void kv_fd_mark(u32 tgid, s64 fd)
{
    struct kv_fd_key k = kv_fd_key(tgid, fd);
    u8 one = 1;
    fd_skip.update(&k, &one);
}

static __always_inline int kv_fd_born_skipped(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    if (ret >= 0 && kv_is_target(id >> 32))
        kv_fd_mark(id >> 32, ret);
    return 0;
}

#ifdef KV_BORN_ACCEPT
TRACEPOINT_PROBE(syscalls, sys_exit_accept)         { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_ACCEPT4
TRACEPOINT_PROBE(syscalls, sys_exit_accept4)        { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_SOCKET
TRACEPOINT_PROBE(syscalls, sys_exit_socket)         { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_EVENTFD
TRACEPOINT_PROBE(syscalls, sys_exit_eventfd)        { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_EVENTFD2
TRACEPOINT_PROBE(syscalls, sys_exit_eventfd2)       { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_TIMERFD_CREATE
TRACEPOINT_PROBE(syscalls, sys_exit_timerfd_create) { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_SIGNALFD
TRACEPOINT_PROBE(syscalls, sys_exit_signalfd)       { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_SIGNALFD4
TRACEPOINT_PROBE(syscalls, sys_exit_signalfd4)      { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_EPOLL_CREATE
TRACEPOINT_PROBE(syscalls, sys_exit_epoll_create)   { return kv_fd_born_skipped(args->ret); }
#endif
#ifdef KV_BORN_EPOLL_CREATE1
TRACEPOINT_PROBE(syscalls, sys_exit_epoll_create1)  { return kv_fd_born_skipped(args->ret); }
#endif

/* pipe, pipe2 and socketpair return their two numbers through a user array: remembered at
 * entry, read at exit (the kernel has just written it). */
#ifdef KV_BORN_PAIRS
BPF_TABLE("lru_hash", u32, u64, pair_start, 4096);

static __always_inline int kv_pair_enter(const int *fds)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!kv_is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    u64 ptr = (u64)fds;
    pair_start.update(&tid, &ptr);
    return 0;
}

static __always_inline int kv_pair_exit(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u64 *p = pair_start.lookup(&tid);
    if (!p)
        return 0;
    u64 ptr = *p;
    pair_start.delete(&tid);
    int fds[2] = {};
    if (ret < 0 || bpf_probe_read_user(fds, sizeof(fds), (const void *)ptr) < 0)
        return 0;
    kv_fd_mark(id >> 32, fds[0]);
    kv_fd_mark(id >> 32, fds[1]);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_pipe)       { return kv_pair_enter(args->fildes); }
TRACEPOINT_PROBE(syscalls, sys_exit_pipe)        { return kv_pair_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_pipe2)      { return kv_pair_enter(args->fildes); }
TRACEPOINT_PROBE(syscalls, sys_exit_pipe2)       { return kv_pair_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_socketpair) { return kv_pair_enter(args->usockvec); }
TRACEPOINT_PROBE(syscalls, sys_exit_socketpair)  { return kv_pair_exit(args->ret); }
#endif
#endif
