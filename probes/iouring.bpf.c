/* iouring.bpf.c: io_uring requests of traced processes, submission paired with
 * completion by the kernel's request pointer.  The submit tracepoint was renamed
 * io_uring_submit_sqe -> io_uring_submit_req in 6.4; both carry req, user_data, opcode. */

#include "kvtrace.h"

struct kv_uring_start {
    u64 ts;
    u64 user_data;
    u32 tgid;
    u32 tid;
    u32 opcode;
    u32 pad;
};

struct kv_uring_event {
    struct kv_hdr h;       /* tgid/tid: the submitter */
    u64 ts_submit;
    u64 user_data;
    s32 res;
    u32 cflags;
    u32 opcode;
    u32 complete_tid;      /* thread the completion ran on (0 in irq context) */
};

BPF_TABLE("lru_hash", u64, struct kv_uring_start, uring_start, KV_MAX_INFLIGHT);

static __always_inline int kv_uring_submit(u64 req, u64 user_data, u32 opcode)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!kv_is_target(tgid))
        return 0;
    struct kv_uring_start s = {};
    s.ts = bpf_ktime_get_ns();
    s.user_data = user_data;
    s.tgid = tgid;
    s.tid = (u32)id;
    s.opcode = opcode;
    uring_start.update(&req, &s);
    return 0;
}

#ifdef KV_URING_SUBMIT_REQ
TRACEPOINT_PROBE(io_uring, io_uring_submit_req)
{
    return kv_uring_submit((u64)args->req, args->user_data, args->opcode);
}
#else
TRACEPOINT_PROBE(io_uring, io_uring_submit_sqe)
{
    return kv_uring_submit((u64)args->req, args->user_data, args->opcode);
}
#endif

TRACEPOINT_PROBE(io_uring, io_uring_complete)
{
    u64 req = (u64)args->req;
    struct kv_uring_start *s = uring_start.lookup(&req);
    if (!s)
        return 0;
    struct kv_uring_start st = *s;
    uring_start.delete(&req);
    struct kv_uring_event *e = events.ringbuf_reserve(sizeof(struct kv_uring_event));
    if (!e) {
        kv_count_lost(KV_KIND_URING);
        return 0;
    }
    kv_fill_hdr(&e->h, KV_KIND_URING, sizeof(*e), st.tgid, st.tid);
    e->ts_submit = st.ts;
    e->user_data = st.user_data;
    e->res = args->res;
    e->cflags = args->cflags;
    e->opcode = st.opcode;
    e->complete_tid = (u32)bpf_get_current_pid_tgid();
    events.ringbuf_submit(e, 0);
    return 0;
}
