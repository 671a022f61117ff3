/* fileio.bpf.c: file reads and writes by system call, per traced thread.
 *
 * Each call is remembered at sys_enter_* by thread id and emitted at sys_exit_* with the
 * result and latency.  Paths come from fdopen.bpf.c (openat results) and, for files
 * opened before the attach, from /proc/PID/fd in user space.  Every call is also counted in
 * the aggregation maps (kvtrace.h) per (pid, system call) before the raw event is sampled.
 * Descriptors user space found are not files (KV_FD_SKIP, see kvtrace.h) are skipped.
 */

#include "kvtrace.h"

#define KV_SYS_READ     0
#define KV_SYS_PREAD64  1
#define KV_SYS_READV    2
#define KV_SYS_PREADV   3
#define KV_SYS_PREADV2  4
#define KV_SYS_WRITE    5
#define KV_SYS_PWRITE64 6
#define KV_SYS_WRITEV   7
#define KV_SYS_PWRITEV  8
#define KV_SYS_PWRITEV2 9

struct kv_sys_start {
    u64 ts;
    s64 pos;
    u64 count;
    s32 fd;
    u32 sys;
};

struct kv_fileio_event {
    struct kv_hdr h;
    u64 ts_enter;
    s64 ret;
    s64 pos;       /* -1 when the call has no offset */
    u64 count;     /* bytes asked for; the iovec count for the vector calls */
    s32 fd;
    u16 sys;       /* KV_SYS_* */
    u16 weight;    /* events this one stands for (1 unless sampled) */
};

BPF_TABLE("lru_hash", u32, struct kv_sys_start, sys_start, KV_MAX_INFLIGHT);
/* Calls in sys_start not yet taken out by their exit.  Most exits a serving process makes are
 * of calls skipped at entry (its sockets and eventfds), and with nothing in flight they return
 * without a hash lookup.  Only ever too high (an entry the LRU dropped, a thread gone mid-call):
 * then exits look up as before. */
BPF_ARRAY(sys_inflight, s64, 1);

static __always_inline int kv_sys_enter(u32 sys, s64 fd, u64 count, s64 pos)
{
    u64 id = bpf_get_current_pid_tgid();
#ifdef KV_FD_SKIP
    /* before the target test: most reads and writes of a serving process are of sockets and
     * eventfds, and only a traced process's numbers are ever put here */
    struct kv_fd_key fk = kv_fd_key(id >> 32, fd);
    if (fd_skip.lookup(&fk))
        return 0;   /* not a file (see kvtrace.h) */
#endif
    if (!kv_is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct kv_sys_start s = {};
    s.ts = bpf_ktime_get_ns();
    s.fd = (s32)fd;
    s.count = count;
    s.pos = pos;
    s.sys = sys;
    if (sys_start.insert(&tid, &s) == 0) {
        int zero = 0;
        s64 *n = sys_inflight.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
    } else {
        sys_start.update(&tid, &s);   /* an exit the kernel did not run: this call takes its place */
    }
    return 0;
}

static __always_inline int kv_sys_exit(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    int zero = 0;
    s64 *n = sys_inflight.lookup(&zero);
    if (n && *n <= 0)
        return 0;
    struct kv_sys_start *s = sys_start.lookup(&tid);
    if (!s)
        return 0;
    struct kv_sys_start st = *s;
    if (sys_start.delete(&tid) == 0 && n)
        __sync_fetch_and_add(n, -1);
    u64 now = bpf_ktime_get_ns();
    int vector = st.sys == KV_SYS_READV || st.sys == KV_SYS_PREADV || st.sys == KV_SYS_PREADV2 ||
                 st.sys == KV_SYS_WRITEV || st.sys == KV_SYS_PWRITEV || st.sys == KV_SYS_PWRITEV2;
    kv_aggregate(KV_KIND_FILEIO, id >> 32, 0, st.sys, ret > 0 ? ret : 0, ret < 0, now - st.ts,
                 vector ? 0 : st.count, 0);
    u32 weight = kv_sample(KV_KIND_FILEIO);
    if (!weight)
        return 0;
    struct kv_fileio_event *e = events.ringbuf_reserve(sizeof(struct kv_fileio_event));
    if (!e) {
        kv_sample_lost(KV_KIND_FILEIO, weight);
        return 0;
    }
    kv_sample_ok(KV_KIND_FILEIO);
    kv_fill_hdr(&e->h, KV_KIND_FILEIO, sizeof(*e), id >> 32, tid);
    e->h.ts = now;
    e->ts_enter = st.ts;
    e->ret = ret;
    e->pos = st.pos;
    e->count = st.count;
    e->fd = st.fd;
    e->sys = st.sys;
    e->weight = weight;
    kv_submit(e, sizeof(*e));
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_read)     { return kv_sys_enter(KV_SYS_READ, args->fd, args->count, -1); }
TRACEPOINT_PROBE(syscalls, sys_exit_read)      { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_pread64)  { return kv_sys_enter(KV_SYS_PREAD64, args->fd, args->count, args->pos); }
TRACEPOINT_PROBE(syscalls, sys_exit_pread64)   { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv)    { return kv_sys_enter(KV_SYS_READV, args->fd, args->vlen, -1); }
TRACEPOINT_PROBE(syscalls, sys_exit_readv)     { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_preadv)   { return kv_sys_enter(KV_SYS_PREADV, args->fd, args->vlen, args->pos_l); }
TRACEPOINT_PROBE(syscalls, sys_exit_preadv)    { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_preadv2)  { return kv_sys_enter(KV_SYS_PREADV2, args->fd, args->vlen, args->pos_l); }
TRACEPOINT_PROBE(syscalls, sys_exit_preadv2)   { return kv_sys_exit(args->ret); }
#ifdef KV_TRACE_WRITES
TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
#ifdef KV_HAVE_USERMARK
    if (kv_usermark_write((int)args->fd, args->buf, args->count))
        return 0;
#endif
    return kv_sys_enter(KV_SYS_WRITE, args->fd, args->count, -1);
}
TRACEPOINT_PROBE(syscalls, sys_exit_write)     { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwrite64) { return kv_sys_enter(KV_SYS_PWRITE64, args->fd, args->count, args->pos); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwrite64)  { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev)   { return kv_sys_enter(KV_SYS_WRITEV, args->fd, args->vlen, -1); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev)    { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev)  { return kv_sys_enter(KV_SYS_PWRITEV, args->fd, args->vlen, args->pos_l); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwritev)   { return kv_sys_exit(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev2) { return kv_sys_enter(KV_SYS_PWRITEV2, args->fd, args->vlen, args->pos_l); }
TRACEPOINT_PROBE(syscalls, sys_exit_pwritev2)  { return kv_sys_exit(args->ret); }
#endif

