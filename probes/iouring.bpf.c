/* iouring.bpf.c: io_uring requests of traced processes, submission paired with
 * completion by the kernel's request pointer.  The submit tracepoint was renamed
 * io_uring_submit_sqe -> io_uring_submit_req in 6.4; both carry req, user_data, opcode.
 * Every completion is also counted in the aggregation maps (kvtrace.h) per (pid, opcode)
 * before the raw event is sampled. */

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
    u16 opcode;
    u16 weight;            /* events this one stands for (1 unless sampled) */
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

/* Opcodes that move file data (kvtrace/capture/iouring.py DATA_OPS): READV, WRITEV,
 * READ_FIXED, WRITE_FIXED, READ, WRITE, READ_MULTISHOT. */
static __always_inline int kv_uring_data_op(u32 op)
{
    return op == 1 || op == 2 || op == 4 || op == 5 || op == 22 || op == 23 || op == 49;
}

TRACEPOINT_PROBE(io_uring, io_uring_complete)
{
    u64 req = (u64)args->req;
    struct kv_uring_start *s = uring_start.lookup(&req);
    if (!s)
        return 0;
    struct kv_uring_start st = *s;
    uring_start.delete(&req);
    u64 now = bpf_ktime_get_ns();
    s32 res = args->res;
    kv_aggregate(KV_KIND_URING, st.tgid, 0, st.opcode, res > 0 && kv_uring_data_op(st.opcode) ? res : 0,
                 res < 0, now - st.ts, 0, 0);
    u32 weight = kv_sample(KV_KIND_URING);
    if (!weight)
        return 0;
    struct kv_uring_event *e = events.ringbuf_reserve(sizeof(struct kv_uring_event));
    if (!e) {
        kv_sample_lost(KV_KIND_URING, weight);
        return 0;
    }
    kv_sample_ok(KV_KIND_URING);
    kv_fill_hdr(&e->h, KV_KIND_URING, sizeof(*e), st.tgid, st.tid);
    e->h.ts = now;
    e->ts_submit = st.ts;
    e->user_data = st.user_data;
    e->res = res;
    e->cflags = args->cflags;
    e->opcode = st.opcode;
    e->weight = weight;
    e->complete_tid = (u32)bpf_get_current_pid_tgid();
    kv_submit(e, sizeof(*e));
    return 0;
}
